//! A worker loop as a service: a small `select!` shell on the cancellation
//! token around a `run_once` body that tests call directly. Every await of
//! the loop (the body, and the wait between rounds) is cancellable; a
//! service may let a round already under way finish, briefly, first.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// One round of a loop, and how long to wait before the next.
pub trait Service {
    /// For logs.
    fn name(&self) -> &'static str;

    /// One round. Returns the wait before the next one, or None to stop the loop.
    fn run_once(&mut self) -> impl Future<Output = Option<Duration>> + Send;

    /// How long a round already under way may go on once the loop is
    /// cancelled (None: it is dropped at once).
    fn finishing_grace(&self) -> Option<Duration> {
        None
    }
}

/// Runs `service` until `cancel` fires or a round says stop. A round that is
/// cancelled mid-way (past its service's [`Service::finishing_grace`])
/// leaves its work to Redis: anything it had claimed stays pending
/// (un-acked) and is reclaimed.
pub async fn run<S: Service>(mut service: S, cancel: CancellationToken) {
    let grace = service.finishing_grace();
    loop {
        let round = service.run_once();
        tokio::pin!(round);
        let wait = tokio::select! {
            biased;
            _ = cancel.cancelled() => {
                if let Some(grace) = grace {
                    let _ = tokio::time::timeout(grace, round).await;
                }
                break;
            }
            wait = &mut round => wait,
        };
        let Some(wait) = wait else { break };
        if wait.is_zero() {
            // Yield between busy rounds, so cancellation is seen promptly.
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    tracing::debug!(service = service.name(), "stopped");
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    struct Counter {
        rounds: Arc<AtomicU32>,
        stop_after: u32,
    }

    impl Service for Counter {
        fn name(&self) -> &'static str {
            "counter"
        }

        async fn run_once(&mut self) -> Option<Duration> {
            let n = self.rounds.fetch_add(1, Ordering::SeqCst) + 1;
            (n < self.stop_after).then_some(Duration::from_secs(60))
        }
    }

    fn counter(stop_after: u32) -> (Counter, Arc<AtomicU32>) {
        let rounds = Arc::new(AtomicU32::new(0));
        (
            Counter {
                rounds: rounds.clone(),
                stop_after,
            },
            rounds,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_service_waits_between_rounds_and_stops_when_a_round_says_so() {
        let (c, rounds) = counter(3);
        let started = tokio::time::Instant::now();
        run(c, CancellationToken::new()).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 3);
        assert_eq!(started.elapsed(), Duration::from_secs(120), "two waits of 60 s");
    }

    #[tokio::test(start_paused = true)]
    async fn cancellation_interrupts_the_wait() {
        let (c, rounds) = counter(u32::MAX);
        let cancel = CancellationToken::new();
        let handle = tokio::spawn(run(c, cancel.clone()));
        tokio::time::sleep(Duration::from_secs(90)).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 2, "rounds at 0 s and 60 s");
        let cancelled_at = tokio::time::Instant::now();
        cancel.cancel();
        handle.await.unwrap();
        assert_eq!(cancelled_at.elapsed(), Duration::ZERO, "the wait was cut short");
        assert_eq!(rounds.load(Ordering::SeqCst), 2);
    }
}
