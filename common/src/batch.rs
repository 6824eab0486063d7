//! Group commit: callers ask one at a time and wait for their own answer;
//! whatever queued up while the previous call ran goes in the next call,
//! together. A lone caller is served at once (no timer, no added latency);
//! under load one Redis script call serves many records.

use std::future::Future;
use std::sync::Mutex;

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
    pub fn new<F, Fut>(max: usize, mut run: F) -> Self
    where
        F: FnMut(Vec<Req>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<Resp>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Queued<Req, Resp>>();
        let max = max.max(1);
        let start = move || {
            tokio::spawn(async move {
                while let Some(first) = rx.recv().await {
                    let mut batch = vec![first];
                    while batch.len() < max {
                        match rx.try_recv() {
                            Ok(next) => batch.push(next),
                            Err(_) => break,
                        }
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
}
