//! The wall clock as the queue's records keep it: Unix milliseconds.

/// Now, in Unix milliseconds (0 before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
