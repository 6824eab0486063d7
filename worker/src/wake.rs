//! The wake-up listener: one blocking XREAD on `bf:wake` (on a connection
//! of its own) instead of every idle service polling every partition. New
//! work wakes the claimer at once; a halt, cancel or resume wakes the
//! watcher; a freed concurrency slot wakes a claimer waiting for one.

use std::sync::Arc;
use std::time::Duration;

use common::store::RedisStore;

use crate::fleet::{Fleet, STORE_ERROR_PAUSE};
use crate::service::Service;

/// How long one blocking read waits (then it simply reads again): inside
/// the connection's 30 s response timeout; a read that times out is an
/// idle worker's command, so it waits as long as it safely can.
const BLOCK: Duration = Duration::from_secs(25);

pub struct Listener {
    fleet: Arc<Fleet>,
    /// Its own connection: a blocking read holds the connection it runs on.
    store: RedisStore,
    /// The last wake-up seen: nothing sent after it is missed.
    cursor: String,
}

impl Listener {
    /// `cursor` is read before the first claim round ([`RedisStore::wake_cursor`]).
    pub fn new(fleet: Arc<Fleet>, store: RedisStore, cursor: String) -> Listener {
        Listener { fleet, store, cursor }
    }
}

impl Service for Listener {
    fn name(&self) -> &'static str {
        "wake"
    }

    async fn run_once(&mut self) -> Option<Duration> {
        match self.store.wait_wake(&self.cursor, BLOCK.as_millis() as u64).await {
            Ok(Some(woken)) => {
                self.cursor = woken.last;
                self.fleet.wake_claimer.notify_one();
                if woken.flags {
                    self.fleet.wake_watcher.notify_one();
                }
                // Slots are what holds some worker back: this one's
                // settlements of those limiters go at once for a while.
                for limiter in self.fleet.all_limiters() {
                    if woken.slots.iter().any(|id| id == limiter.id()) {
                        limiter.slots_bound();
                    }
                }
                Some(Duration::ZERO)
            }
            Ok(None) => Some(Duration::ZERO),
            Err(e) => {
                self.fleet.store_error(&e).await;
                Some(STORE_ERROR_PAUSE)
            }
        }
    }
}
