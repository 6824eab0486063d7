//! A task's slot of the worker's concurrency (`--concurrency`: requests in
//! flight in this process). The slot goes back as soon as the task's call is
//! over and its outcome goes to be stored: the outcome then waits for its
//! group commit (see `queue/redis.rs`) on one of as many storing slots, while
//! another task already calls. Held until the commit, the slot made every
//! record's cycle a commit longer, and a worker whose provider answers at
//! once waited on Redis with its slots (`make bench-queues`, BENCHMARKS.md).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

tokio::task_local! {
    static SLOT: Arc<Slot>;
}

/// A running task's slot, and the storing slot its outcome moves to.
pub struct Slot {
    storing: Arc<Semaphore>,
    /// The call's slot (until handed over), then the storing one.
    held: Mutex<Held>,
}

/// The permit is held for its drop, which gives it back.
enum Held {
    Call { _permit: OwnedSemaphorePermit },
    Storing { _permit: OwnedSemaphorePermit },
    Nothing,
}

impl Slot {
    /// The task's slot (`call`), and the storing slots its outcome may take.
    pub fn new(call: OwnedSemaphorePermit, storing: Arc<Semaphore>) -> Arc<Slot> {
        Arc::new(Slot {
            storing,
            held: Mutex::new(Held::Call { _permit: call }),
        })
    }

    /// Runs the task's work with this slot as its own (see [`storing_outcome`]).
    /// A plain function, not an `async` one: an `async fn` would hold `work`
    /// twice (its argument, and inside the future it awaits), and a task's
    /// work is a future of many kilobytes, copied whenever it moves.
    pub fn scope<F: Future>(self: &Arc<Self>, work: F) -> impl Future<Output = F::Output> {
        SLOT.scope(self.clone(), work)
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The call's slot goes back once the outcome holds a storing slot; with
    /// none free, the task keeps its own until it ends (as many outcomes as
    /// slots wait for their commit at most).
    fn hand_over(&self) {
        let mut held = self.held();
        if matches!(*held, Held::Call { .. })
            && let Ok(storing) = self.storing.clone().try_acquire_owned()
        {
            *held = Held::Storing { _permit: storing };
        }
    }

    /// Whether the task still holds its call's slot.
    pub fn holds_call(&self) -> bool {
        matches!(*self.held(), Held::Call { .. })
    }

    /// The task ended: whatever it holds goes back.
    pub fn release(&self) {
        *self.held() = Held::Nothing;
    }
}

/// The running task's call is over and its outcome goes to be stored: its
/// slot goes back (see [`Slot::hand_over`]). Outside a task's scope, nothing.
pub fn storing_outcome() {
    let _ = SLOT.try_with(|s| s.hand_over());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_outcome_going_to_be_stored_gives_its_call_slot_back_while_a_storing_slot_is_free() {
        let calls = Arc::new(Semaphore::new(2));
        let storing = Arc::new(Semaphore::new(1));
        let a = Slot::new(calls.clone().try_acquire_owned().unwrap(), storing.clone());
        let b = Slot::new(calls.clone().try_acquire_owned().unwrap(), storing.clone());
        assert_eq!(calls.available_permits(), 0);
        // Outside a task's scope nothing moves.
        storing_outcome();
        assert!(a.holds_call() && b.holds_call());
        a.scope(async { storing_outcome() }).await;
        assert!(!a.holds_call(), "the call's slot went back");
        assert_eq!(calls.available_permits(), 1);
        assert_eq!(storing.available_permits(), 0, "the outcome holds the storing slot");
        // No storing slot free: the second task keeps its call's slot.
        b.scope(async { storing_outcome() }).await;
        assert!(b.holds_call());
        assert_eq!(calls.available_permits(), 1);
        a.release();
        assert_eq!(storing.available_permits(), 1, "the ended task's storing slot is back");
        b.scope(async { storing_outcome() }).await;
        assert!(!b.holds_call());
        b.release();
        assert_eq!((calls.available_permits(), storing.available_permits()), (2, 1));
    }

    /// A task's work is a large future: the scope around it adds only the
    /// task-local's few bytes, it does not hold the work twice.
    #[test]
    fn a_scope_holds_its_work_once() {
        let slot = Slot::new(
            Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap(),
            Arc::new(Semaphore::new(1)),
        );
        let big = [0u8; 8192];
        let work = async move {
            tokio::task::yield_now().await;
            big.len()
        };
        let alone = std::mem::size_of_val(&work);
        assert!(alone >= 8192);
        let scoped = slot.scope(work);
        assert!(std::mem::size_of_val(&scoped) < alone + 256, "{alone}");
    }
}
