//! Standard error that never stalls or kills a process. Log lines (and the
//! binaries' own messages) go through a bounded queue to a writer thread of
//! their own: a full or closed stderr (`worker 2>&1 | head -1`) never blocks
//! the runtime and never panics it; lines that cannot be written are dropped
//! and counted ([`dropped`], exported as `batchfleet_log_lines_dropped_total`).
//! `eprintln!` panics on a closed stderr and `std::io::stderr()` blocks on a
//! full one: neither is used for anything a process says while it runs.

use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

/// Lines waiting for the writer thread, at most.
const QUEUE: usize = 8192;

static SENDER: OnceLock<SyncSender<Vec<u8>>> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Lines queued, and lines the writer thread is done with (written or dropped).
static QUEUED: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);

/// Lines dropped so far (stderr closed or full).
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Whether text on standard error may carry colours: only on a terminal,
/// and never when `NO_COLOR` is set to anything but the empty string
/// (<https://no-color.org>).
pub fn colour() -> bool {
    use std::io::IsTerminal;
    colour_on(std::io::stderr().is_terminal())
}

/// Whether a stream that is (or is not) a terminal may carry colours.
pub fn colour_on(terminal: bool) -> bool {
    terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn sender() -> &'static SyncSender<Vec<u8>> {
    SENDER.get_or_init(|| {
        let (tx, rx) = sync_channel(QUEUE);
        let started = std::thread::Builder::new()
            .name("stderr-writer".into())
            .spawn(move || write_all(rx, std::io::stderr()));
        if started.is_err() {
            // No thread: every line is counted as dropped (the queue fills).
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        tx
    })
}

/// The writer thread: writes each line whole; after the first failed write
/// (the reader went away) every line is dropped and counted.
fn write_all(rx: Receiver<Vec<u8>>, mut out: impl Write) {
    let mut closed = false;
    for line in rx {
        if !closed && out.write_all(&line).and_then(|()| out.flush()).is_err() {
            closed = true;
        }
        if closed {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        DONE.fetch_add(1, Ordering::Relaxed);
    }
}

/// Queues one line (with its newline); drops it when the queue is full.
pub fn send(line: Vec<u8>) {
    if line.is_empty() {
        return;
    }
    QUEUED.fetch_add(1, Ordering::Relaxed);
    match sender().try_send(line) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            DONE.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Writes a message line to stderr through the queue: `eprintln!` that
/// neither blocks nor panics.
pub fn line(text: &str) {
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(b'\n');
    send(bytes);
}

/// Waits up to `within` for the lines queued so far to be written (at
/// exit: the last words are not lost to a reader that is still there, and
/// a stuck one does not keep the process).
pub fn flush(within: Duration) {
    let target = QUEUED.load(Ordering::Relaxed);
    let until = Instant::now() + within;
    while DONE.load(Ordering::Relaxed) < target && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `eprintln!` through [`line`]: never blocks on a full stderr, never
/// panics on a closed one.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::log::line(&format!($($arg)*))
    };
}

/// A `tracing_subscriber` writer: each event is gathered whole and queued
/// when the formatter is done with it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stderr;

/// One event's bytes.
#[derive(Debug, Default)]
pub struct EventLine(Vec<u8>);

impl Write for EventLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventLine {
    fn drop(&mut self) {
        send(std::mem::take(&mut self.0));
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = EventLine;

    fn make_writer(&'a self) -> EventLine {
        EventLine::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A test's stand-in for stderr (closed: every write fails like a broken pipe).
    struct Shared(Arc<Mutex<Vec<u8>>>, bool);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.1 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_are_written_whole_and_a_closed_reader_only_drops_them() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = sync_channel(4);
        let out = Shared(seen.clone(), false);
        let t = std::thread::spawn(move || write_all(rx, out));
        tx.send(b"one\n".to_vec()).unwrap();
        tx.send(b"two\n".to_vec()).unwrap();
        drop(tx);
        t.join().unwrap();
        assert_eq!(&*seen.lock().unwrap(), b"one\ntwo\n");

        let before = dropped();
        let (tx, rx) = sync_channel(4);
        let t = std::thread::spawn(move || write_all(rx, Shared(seen, true)));
        tx.send(b"lost\n".to_vec()).unwrap();
        tx.send(b"lost too\n".to_vec()).unwrap();
        drop(tx);
        t.join().unwrap();
        assert!(dropped() >= before + 2, "counted, never a panic");
    }
}
