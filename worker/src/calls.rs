//! The model calls of this process in flight, as the cost ledger would
//! record each if it never reached its outcome (see [`CallsInFlight`]).

use std::collections::{BTreeMap, HashMap};

use common::ledger::{Fate, PaidCall};

/// The model calls of this process, each as the ledger would record it if
/// it never reached its outcome: waiting for the answer (tokens estimated),
/// or answered and committing. A drain that runs out of time records the
/// waiting ones as paid without a result ([`CallsInFlight::abandon`]) and,
/// after a short grace, the ones still committing as lost
/// ([`CallsInFlight::lost_at_exit`]): none is dropped silently, none counted
/// twice (an answer that comes after its call was recorded is not recorded
/// again). Also the paid calls whose outcome could not be stored, until
/// Redis takes them.
#[derive(Default)]
pub struct CallsInFlight {
    next: std::sync::atomic::AtomicU64,
    calls: std::sync::Mutex<HashMap<u64, InFlight>>,
    lost: std::sync::Mutex<Vec<(String, u32, PaidCall)>>,
}

struct InFlight {
    job: String,
    partition: u32,
    call: PaidCall,
    /// Answered: its outcome (with the call) is being stored.
    committing: bool,
}

/// One call in [`CallsInFlight`], from its request to its stored outcome.
pub(crate) struct CallInFlight<'a> {
    owner: &'a CallsInFlight,
    id: u64,
}

type PerJob = BTreeMap<String, Vec<(u32, PaidCall)>>;

impl CallsInFlight {
    pub(crate) fn start(&self, job: &str, partition: u32, if_cut_off: PaidCall) -> CallInFlight<'_> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let call = InFlight {
            job: job.to_owned(),
            partition,
            call: if_cut_off,
            committing: false,
        };
        self.lock().insert(id, call);
        CallInFlight { owner: self, id }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, InFlight>> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls waiting or committing now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls answered whose outcome is still being stored.
    pub fn committing(&self) -> usize {
        self.lock().values().filter(|c| c.committing).count()
    }

    fn take(&self, committing: bool) -> PerJob {
        let mut out = PerJob::new();
        self.lock().retain(|_, c| {
            if c.committing != committing {
                return true;
            }
            out.entry(c.job.clone())
                .or_default()
                .push((c.partition, c.call.clone()));
            false
        });
        out
    }

    /// Takes every call still waiting for its answer, per job with its
    /// partition: paid without a result (estimated).
    pub fn abandon(&self) -> PerJob {
        self.take(false)
    }

    /// Takes every call whose outcome is still being stored: lost.
    pub fn lost_at_exit(&self) -> PerJob {
        self.take(true)
    }

    /// A paid call whose outcome could not be stored: recorded when Redis can.
    pub(crate) fn lose(&self, job: &str, partition: u32, mut call: PaidCall) {
        call.fate = Fate::Lost;
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((job.to_owned(), partition, call));
    }

    /// The lost calls not recorded yet, per job (see [`CallsInFlight::keep_lost`]).
    pub fn take_lost(&self) -> PerJob {
        let mut out = PerJob::new();
        for (job, partition, call) in std::mem::take(&mut *self.lost.lock().unwrap_or_else(|e| e.into_inner())) {
            out.entry(job).or_default().push((partition, call));
        }
        out
    }

    /// Gives back lost calls Redis did not take (tried again later).
    pub fn keep_lost(&self, job: &str, calls: Vec<(u32, PaidCall)>) {
        let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
        lost.extend(calls.into_iter().map(|(p, c)| (job.to_owned(), p, c)));
    }
}

impl CallInFlight<'_> {
    /// The call came back with `paid` (None: nothing billable). Returns it
    /// for the outcome's store call, or None when a drain already recorded
    /// the call as cut off; until the outcome is stored, a drain that runs
    /// out records it as lost.
    pub(crate) fn answered(&self, paid: Option<PaidCall>) -> Option<PaidCall> {
        let mut calls = self.owner.lock();
        let entry = calls.get_mut(&self.id)?;
        match &paid {
            Some(p) => {
                entry.call = PaidCall {
                    fate: Fate::Lost,
                    ..p.clone()
                };
                entry.committing = true;
            }
            None => {
                calls.remove(&self.id);
            }
        }
        paid
    }
}

impl Drop for CallInFlight<'_> {
    fn drop(&mut self) {
        self.owner.lock().remove(&self.id);
    }
}
