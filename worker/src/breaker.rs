//! The circuit breaker for systematic provider errors: a wrong key that a
//! proxy answers with 400, a model the server does not serve, a parameter it
//! refuses. Such an error is about the job, not the record: until the job's
//! provider has answered once ("proven"), each worker sends one call
//! at a time for it (any answer proves it, valid or not), a non-retryable
//! error does not send the record to
//! review (it waits), and when `threshold` calls failed with the same error
//! (fleet-wide, counted in Redis) the job halts with the provider's message.
//! Once proven, the same error `threshold` times in a row at one worker
//! halts it too; an error that is about one record (one input too long)
//! still sends that record to review.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// One job's breaker state in this worker.
#[derive(Debug)]
pub struct Breaker {
    /// Calls failed with one signature before the job halts.
    pub threshold: u64,
    /// The job's provider answered at least once (from Redis, or seen here).
    proven: AtomicBool,
    /// Whether this worker already told Redis.
    told: AtomicBool,
    /// This job's calls in flight in this worker (one at a time until proven).
    pub in_flight: AtomicUsize,
    /// The last non-retryable error here and how many times in a row.
    streak: Mutex<(String, u64)>,
}

/// What to do with a non-retryable provider error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// About this record: review it.
    Record,
    /// Maybe about the job: keep the record waiting, look again later.
    Suspect,
    /// About the job: halt it.
    Halt,
}

impl Breaker {
    pub fn new(threshold: u64) -> Breaker {
        Breaker {
            threshold: threshold.max(1),
            proven: AtomicBool::new(false),
            told: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            streak: Mutex::new((String::new(), 0)),
        }
    }

    pub fn proven(&self) -> bool {
        self.proven.load(Ordering::Relaxed)
    }

    /// From Redis (the watcher): another worker saw a valid answer.
    pub fn set_proven(&self) {
        self.proven.store(true, Ordering::Relaxed);
    }

    /// An answer here: true when Redis has to be told (once per worker).
    pub fn on_answer(&self) -> bool {
        self.proven.store(true, Ordering::Relaxed);
        self.reset();
        !self.told.swap(true, Ordering::Relaxed)
    }

    /// Any outcome that is not a non-retryable error breaks the streak.
    pub fn reset(&self) {
        let mut s = self.streak.lock().unwrap_or_else(|e| e.into_inner());
        s.1 = 0;
    }

    /// Judges a non-retryable error with `signature`, counted `fleet_count`
    /// times fleet-wide (this one included).
    pub fn judge(&self, signature: &str, fleet_count: u64) -> Verdict {
        let in_a_row = {
            let mut s = self.streak.lock().unwrap_or_else(|e| e.into_inner());
            if s.0 == signature {
                s.1 += 1;
            } else {
                *s = (signature.to_owned(), 1);
            }
            s.1
        };
        if !self.proven() {
            if fleet_count >= self.threshold {
                Verdict::Halt
            } else {
                Verdict::Suspect
            }
        } else if in_a_row >= self.threshold {
            Verdict::Halt
        } else {
            Verdict::Record
        }
    }

    /// How many more calls of this job may start now (`usize::MAX` once proven).
    pub fn room(&self) -> usize {
        if self.proven() {
            usize::MAX
        } else {
            1usize.saturating_sub(self.in_flight.load(Ordering::Relaxed))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unproven_job_halts_at_the_threshold_and_waits_before() {
        let b = Breaker::new(3);
        assert_eq!(b.room(), 1, "one call at a time until proven");
        assert_eq!(b.judge("http_400:no_db_connection", 1), Verdict::Suspect);
        assert_eq!(b.judge("http_400:no_db_connection", 2), Verdict::Suspect);
        assert_eq!(b.judge("http_400:no_db_connection", 3), Verdict::Halt);
    }

    #[test]
    fn a_proven_job_reviews_single_errors_and_halts_on_a_streak() {
        let b = Breaker::new(3);
        assert!(b.on_answer(), "Redis is told once");
        assert!(!b.on_answer());
        assert_eq!(b.room(), usize::MAX);
        assert_eq!(b.judge("http_400:context_length_exceeded", 50), Verdict::Record);
        b.reset();
        assert_eq!(b.judge("http_400:x", 1), Verdict::Record);
        assert_eq!(
            b.judge("http_400:y", 1),
            Verdict::Record,
            "another error starts another streak"
        );
        assert_eq!(b.judge("http_400:y", 1), Verdict::Record);
        assert_eq!(b.judge("http_400:y", 1), Verdict::Halt);
    }
}
