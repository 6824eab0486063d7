//! Group commit: callers ask one at a time and wait for their own answer;
//! whatever queued up while the previous call ran goes in the next call,
//! together. A lone caller is served at once (no timer, no added latency);
//! under load one Redis script call serves many records.
//!
//! A batcher may also linger ([`GroupCommit::lingering`]): a batch of
//! requests none of which is urgent waits up to a while for more before
//! its call, so a steady trickle shares calls too. Its callers wait that
//! much longer for their answers; an urgent request ends the wait.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

type Queued<Req, Resp> = (Req, oneshot::Sender<Resp>);

/// Batches requests to `run`, at most `max` a call, one call at a time.
pub struct GroupCommit<Req, Resp> {
    tx: mpsc::UnboundedSender<Queued<Req, Resp>>,
    /// The loop is started on the first call (inside the runtime).
    start: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl<Req: Send + 'static, Resp: Send + 'static> GroupCommit<Req, Resp> {
    /// `run` answers a batch with one response per request, in order; a
    /// request it answers nothing for gets `None` from [`GroupCommit::call`].
    pub fn new<F, Fut>(max: usize, run: F) -> Self
    where
        F: FnMut(Vec<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<Resp>> + Send + 'static,
    {
        Self::lingering(max, Duration::ZERO, |_| true, run)
    }

    /// As [`GroupCommit::new`], but a batch with no `urgent` request in it
    /// waits up to `linger` for more (until it is full, or an urgent one
    /// comes) before its call, counted from when the batch is started (a
    /// request queued while the previous call ran waits that call too).
    pub fn lingering<U, F, Fut>(max: usize, linger: Duration, urgent: U, mut run: F) -> Self
    where
        U: Fn(&Req) -> bool + Send + 'static,
        F: FnMut(Vec<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<Resp>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Queued<Req, Resp>>();
        let max = max.max(1);
        let start = move || {
            tokio::spawn(async move {
                while let Some(first) = rx.recv().await {
                    let until = tokio::time::Instant::now() + linger;
                    let mut now = urgent(&first.0);
                    let mut batch = vec![first];
                    while batch.len() < max {
                        let next = match rx.try_recv() {
                            Ok(next) => next,
                            Err(_) if now || linger.is_zero() => break,
                            // Waiting for more: a closed channel or the
                            // linger's end sends what there is.
                            Err(_) => match tokio::time::timeout_at(until, rx.recv()).await {
                                Ok(Some(next)) => next,
                                _ => break,
                            },
                        };
                        now |= urgent(&next.0);
                        batch.push(next);
                    }
                    let (reqs, replies): (Vec<Req>, Vec<oneshot::Sender<Resp>>) = batch.into_iter().unzip();
                    for (reply, resp) in replies.into_iter().zip(run(reqs).await) {
                        let _ = reply.send(resp);
                    }
                }
            });
        };
        GroupCommit {
            tx,
            start: Mutex::new(Some(Box::new(start))),
        }
    }

    /// Queues `req` and waits for its answer (None: the batch answered
    /// nothing for it, or the runtime is shutting down).
    pub async fn call(&self, req: Req) -> Option<Resp> {
        if let Some(start) = self.start.lock().unwrap_or_else(|e| e.into_inner()).take() {
            start();
        }
        let (reply, answer) = oneshot::channel();
        self.tx.send((req, reply)).ok()?;
        answer.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn callers_that_queue_up_meanwhile_share_one_call_and_each_gets_its_answer() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let g = Arc::new(GroupCommit::new(8, move |reqs: Vec<u32>| {
            seen.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                reqs.into_iter().map(|r| r * 10).collect()
            }
        }));
        let mut tasks = Vec::new();
        for i in 0..20u32 {
            let g = g.clone();
            tasks.push(tokio::spawn(async move { (i, g.call(i).await) }));
        }
        for t in tasks {
            let (i, got) = t.await.unwrap();
            assert_eq!(got, Some(i * 10));
        }
        let n = calls.load(Ordering::SeqCst);
        assert!((3..20).contains(&n), "20 callers, at most 8 a call: {n} calls");
    }

    #[tokio::test]
    async fn a_request_the_batch_answers_nothing_for_gets_none() {
        let g = GroupCommit::new(4, |_reqs: Vec<u8>| async { Vec::<u8>::new() });
        assert_eq!(g.call(1).await, None);
    }

    /// A batcher lingering 100 ms whose batch runs are counted (each
    /// answers every request with the number of its call); urgent: odd.
    fn lingering() -> (Arc<GroupCommit<u32, usize>>, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let g = GroupCommit::lingering(
            8,
            std::time::Duration::from_millis(100),
            |r: &u32| r % 2 == 1,
            move |reqs: Vec<u32>| {
                let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
                async move { reqs.iter().map(|_| n).collect() }
            },
        );
        (Arc::new(g), calls)
    }

    #[tokio::test(start_paused = true)]
    async fn a_lingering_batch_gathers_a_trickle_into_one_call_and_answers_within_its_linger() {
        let (g, calls) = lingering();
        let started = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for i in 0..4u32 {
            let g = g.clone();
            tasks.push(tokio::spawn(async move { g.call(i * 2).await }));
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for t in tasks {
            assert_eq!(
                t.await.unwrap(),
                Some(1),
                "four requests 20 ms apart share the first call"
            );
        }
        let waited = started.elapsed();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(
            waited >= std::time::Duration::from_millis(100) && waited < std::time::Duration::from_millis(110),
            "the batch went when its linger ended: {waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_urgent_request_sends_its_batch_at_once() {
        let (g, calls) = lingering();
        let started = tokio::time::Instant::now();
        let waiting = {
            let g = g.clone();
            tokio::spawn(async move { g.call(2).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        assert_eq!(g.call(3).await, Some(1), "the urgent one joins the waiting batch");
        assert_eq!(waiting.await.unwrap(), Some(1));
        assert!(started.elapsed() < std::time::Duration::from_millis(20));
        assert_eq!(g.call(5).await, Some(2), "an urgent one alone goes at once");
        assert!(started.elapsed() < std::time::Duration::from_millis(20));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_does_not_wait_out_the_linger() {
        let (g, calls) = lingering();
        let started = tokio::time::Instant::now();
        let tasks: Vec<_> = (0..8u32)
            .map(|i| {
                let g = g.clone();
                tokio::spawn(async move { g.call(i * 2).await })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), Some(1));
        }
        assert!(started.elapsed() < std::time::Duration::from_millis(100));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
