//! Many record ids held in little memory, however many there are: 32 bytes
//! for the 64 lowercase hex digits every id batchfleet makes (a `String` of
//! one takes about 90), the text for anything else; split into 256 buckets
//! (by an id's first byte, by a hash of any other text), held in memory up
//! to a budget and in an unlinked temporary file beyond it. `status --require-complete` compares the done
//! records' ids with the sink's this way a bucket at a time: at ten million
//! records it holds a few megabytes, not a gigabyte.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A record id's 32 bytes, when it is 64 lowercase hex digits (the text of
/// every id batchfleet makes).
pub fn id_bytes(hex: &[u8]) -> Option<[u8; 32]> {
    const fn digit(c: u8) -> u8 {
        match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => 0xff,
        }
    }
    const DIGITS: [u8; 256] = {
        let mut t = [0u8; 256];
        let mut c = 0;
        while c < 256 {
            t[c] = digit(c as u8);
            c += 1;
        }
        t
    };
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let (hi, lo) = (DIGITS[usize::from(pair[0])], DIGITS[usize::from(pair[1])]);
        if (hi | lo) > 0xf {
            return None;
        }
        *o = hi << 4 | lo;
    }
    Some(out)
}

const BUCKETS: usize = 256;

/// What a set holds in memory before it spills to disk (every bucket's
/// entries together).
pub const DEFAULT_BUDGET: usize = 4 << 20;

/// A key's first byte says what it is: an id's 32 bytes, an id's text, or
/// bytes pushed as they are (shown as hex).
const HEX: u8 = 0;
const TEXT: u8 = 1;
const BYTES: u8 = 2;

/// A multiset of record ids (or of any byte keys, [`push_bytes`](Self::push_bytes)),
/// in memory up to a budget and on disk beyond it. Read back a bucket at a
/// time: [`compare`](Self::compare), [`distinct`](Self::distinct).
#[derive(Debug, Clone)]
pub struct RecordIds {
    /// Each bucket's entries: a key's length (4 bytes, little-endian), then
    /// the key (its kind's byte, then its bytes).
    buckets: Vec<Vec<u8>>,
    held: usize,
    budget: usize,
    len: usize,
    spill: Option<Spill>,
}

/// The spilled runs: each written whole, its buckets one after another.
#[derive(Debug, Clone)]
struct Spill {
    file: Arc<(File, AtomicU64)>,
    /// Each run's buckets' bounds in the file (`BUCKETS + 1` offsets).
    runs: Vec<Vec<u64>>,
}

impl Default for RecordIds {
    fn default() -> RecordIds {
        RecordIds::with_budget(DEFAULT_BUDGET)
    }
}

impl RecordIds {
    /// A set that spills to disk past `budget` bytes in memory.
    pub fn with_budget(budget: usize) -> RecordIds {
        RecordIds {
            buckets: vec![Vec::new(); BUCKETS],
            held: 0,
            budget,
            len: 0,
            spill: None,
        }
    }

    pub fn push(&mut self, id: &str) {
        match id_bytes(id.as_bytes()) {
            Some(b) => self.put(HEX, b[0], &b),
            None => self.put(TEXT, fnv1a(id.as_bytes()), id.as_bytes()),
        }
    }

    /// A key of any bytes (a digest, say), bucketed by its first byte.
    pub fn push_bytes(&mut self, key: &[u8]) {
        self.put(BYTES, key.first().copied().unwrap_or(0), key);
    }

    fn put(&mut self, kind: u8, bucket: u8, key: &[u8]) {
        let b = &mut self.buckets[usize::from(bucket)];
        let n = u32::try_from(key.len() + 1).unwrap_or(u32::MAX);
        b.extend_from_slice(&n.to_le_bytes());
        b.push(kind);
        b.extend_from_slice(key);
        self.held += key.len() + 5;
        self.len += 1;
        if self.held > self.budget {
            self.spill_run();
        }
    }

    /// Writes every bucket's entries to the spill file as one run. A disk
    /// that refuses keeps them in memory.
    fn spill_run(&mut self) {
        if self.spill.is_none() {
            match Spill::create() {
                Ok(s) => self.spill = Some(s),
                Err(e) => return self.keep_in_memory(&e),
            }
        }
        let Some(s) = &mut self.spill else { return };
        match s.write_run(&self.buckets) {
            Ok(()) => {
                // Each bucket keeps room for its share of the next run and an
                // eighth more (ids are uniform: few outgrow it), not the room
                // its vector doubled to.
                let room = self.budget / BUCKETS * 9 / 8;
                for b in &mut self.buckets {
                    b.clear();
                    b.shrink_to(room);
                }
                self.held = 0;
            }
            Err(e) => self.keep_in_memory(&e),
        }
    }

    /// The disk refused: every id is held in memory from now on (as before
    /// sets spilled), said once a process on stderr.
    fn keep_in_memory(&mut self, e: &io::Error) {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, Ordering::Relaxed) {
            crate::errln!(
                "warning: cannot spill record ids to {} ({e}): holding them in memory \
                 (set TMPDIR to a writable directory)",
                std::env::temp_dir().display()
            );
        }
        self.budget = usize::MAX;
    }

    /// How many were pushed (repeats included).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether some were written to disk.
    pub fn spilled(&self) -> bool {
        self.spill.is_some()
    }

    /// Bucket `i`'s entries: those spilled, then those in memory.
    fn bucket(&self, i: usize) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        for (s, bounds) in self.spill.iter().flat_map(|s| s.runs.iter().map(move |r| (s, r))) {
            let at = out.len();
            out.resize(at + (bounds[i + 1] - bounds[i]) as usize, 0);
            s.file.0.read_exact_at(&mut out[at..], bounds[i])?;
        }
        out.extend_from_slice(&self.buckets[i]);
        Ok(out)
    }

    /// Each bucket's keys, sorted (repeats kept), in the buckets' order.
    fn each_bucket(&self, mut f: impl FnMut(Vec<&[u8]>)) -> io::Result<()> {
        for i in 0..BUCKETS {
            let entries = self.bucket(i)?;
            f(sorted_keys(&entries));
        }
        Ok(())
    }

    /// How many differ, and how many repeat one already counted.
    pub fn distinct(&self) -> io::Result<(u64, u64)> {
        let (mut distinct, mut repeats) = (0, 0);
        self.each_bucket(|mut keys| {
            repeats += dedup(&mut keys);
            distinct += keys.len() as u64;
        })?;
        Ok((distinct, repeats))
    }

    /// Every id as text, in the text's order (for a set known to be small).
    pub fn to_strings(&self) -> io::Result<Vec<String>> {
        let mut all = Vec::with_capacity(self.len);
        self.each_bucket(|keys| all.extend(keys.into_iter().map(text)))?;
        all.sort_unstable();
        Ok(all)
    }

    /// One pass over both sets, a bucket at a time: `only_here` gets each id
    /// of `self` that `other` lacks, `only_there` each of `other`'s that
    /// `self` lacks (each once). Returns how many repeats each side held.
    pub fn compare(
        &self,
        other: &RecordIds,
        mut only_here: impl FnMut(String),
        mut only_there: impl FnMut(String),
    ) -> io::Result<(u64, u64)> {
        let mut repeats = (0, 0);
        for i in 0..BUCKETS {
            let (here, there) = (self.bucket(i)?, other.bucket(i)?);
            let (mut a, mut b) = (sorted_keys(&here), sorted_keys(&there));
            repeats.0 += dedup(&mut a);
            repeats.1 += dedup(&mut b);
            merge(&a, &b, |k| only_here(text(k)), |k| only_there(text(k)));
        }
        Ok(repeats)
    }
}

impl<'a> FromIterator<&'a str> for RecordIds {
    fn from_iter<I: IntoIterator<Item = &'a str>>(ids: I) -> RecordIds {
        let mut all = RecordIds::default();
        ids.into_iter().for_each(|id| all.push(id));
        all
    }
}

impl Spill {
    /// A file in the temporary directory, unlinked at once: nothing is left
    /// behind when the process ends, however it ends.
    fn create() -> io::Result<Spill> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path: PathBuf = std::env::temp_dir().join(format!(
            "batchfleet-ids-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        std::fs::remove_file(&path)?;
        Ok(Spill {
            file: Arc::new((file, AtomicU64::new(0))),
            runs: Vec::new(),
        })
    }

    /// Appends one run: every bucket's entries, one after another.
    fn write_run(&mut self, buckets: &[Vec<u8>]) -> io::Result<()> {
        let size: u64 = buckets.iter().map(|b| b.len() as u64).sum();
        let mut at = self.file.1.fetch_add(size, Ordering::SeqCst);
        let mut bounds = Vec::with_capacity(BUCKETS + 1);
        for b in buckets {
            bounds.push(at);
            self.file.0.write_all_at(b, at)?;
            at += b.len() as u64;
        }
        bounds.push(at);
        self.runs.push(bounds);
        Ok(())
    }
}

/// The keys of a bucket's entries, sorted (a length past the end, which
/// only a damaged spill file could hold, ends the bucket there).
fn sorted_keys(entries: &[u8]) -> Vec<&[u8]> {
    let mut keys = Vec::new();
    let mut rest = entries;
    while let Some((n, tail)) = rest.split_first_chunk::<4>()
        && let Some((key, tail)) = tail.split_at_checked(u32::from_le_bytes(*n) as usize)
    {
        keys.push(key);
        rest = tail;
    }
    keys.sort_unstable();
    keys
}

/// Removes repeats from sorted keys; returns how many there were.
fn dedup(keys: &mut Vec<&[u8]>) -> u64 {
    let before = keys.len();
    keys.dedup();
    (before - keys.len()) as u64
}

/// A key as the text it was pushed as.
fn text(key: &[u8]) -> String {
    match key.split_first() {
        Some((&TEXT, t)) => String::from_utf8_lossy(t).into_owned(),
        Some((_, b)) => hex::encode(b),
        None => String::new(),
    }
}

/// A byte of FNV-1a: spreads ids that are not hex over the buckets.
fn fnv1a(bytes: &[u8]) -> u8 {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    (h >> 56) as u8
}

fn merge<T: Ord>(a: &[T], b: &[T], mut only_a: impl FnMut(&T), mut only_b: impl FnMut(&T)) {
    let (mut i, mut j) = (0, 0);
    loop {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x == y => {
                i += 1;
                j += 1;
            }
            (Some(x), y) if y.is_none_or(|y| x < y) => {
                only_a(x);
                i += 1;
            }
            (_, Some(y)) => {
                only_b(y);
                j += 1;
            }
            _ => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex_id(n: u32) -> String {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(n.to_le_bytes()))
    }

    #[test]
    fn only_64_lowercase_hex_digits_are_held_as_bytes() {
        let id = "00ff10a9b8c7d6e5f4031221304f5e6d7c8b9aa0b1c2d3e4f5061728394a5b6c";
        assert_eq!(id_bytes(id.as_bytes()).map(hex::encode).as_deref(), Some(id));
        for other in [
            &id[..62],
            &format!("{id}00"),
            &id.to_uppercase(),
            &id.replacen('a', "g", 1),
            &id.replacen('0', " ", 1),
            "",
        ] {
            assert_eq!(id_bytes(other.as_bytes()), None, "{other:?}");
        }
    }

    #[test]
    fn ids_of_both_kinds_come_back_as_the_same_text_in_its_order() {
        let id = "00ff".repeat(16);
        let ids: RecordIds = [id.as_str(), "r2", "r1", ""].into_iter().collect();
        assert_eq!(ids.len(), 4);
        assert_eq!(ids.to_strings().unwrap(), ["".into(), id, "r1".into(), "r2".into()]);
    }

    /// The same ids on both sides, some only on one, repeats on both: what
    /// each side lacks and the repeats, whatever the budget.
    fn sides(budget: usize, n: u32) -> (RecordIds, RecordIds) {
        let (mut done, mut sink) = (RecordIds::with_budget(budget), RecordIds::with_budget(budget));
        for i in 0..n {
            let id = if i % 7 == 0 { format!("row-{i}") } else { hex_id(i) };
            if i % 101 != 3 {
                done.push(&id);
            }
            if i % 83 == 2 {
                done.push(&id);
            }
            if i % 97 != 5 {
                sink.push(&id);
            }
            if i % 89 == 1 {
                sink.push(&id);
            }
        }
        sink.push_bytes(&[]);
        (done, sink)
    }

    #[test]
    fn one_pass_a_bucket_at_a_time_finds_what_each_side_lacks_and_the_repeats() {
        let n = 20_000;
        let (mut missing, mut unknown) = (vec![], vec![]);
        let (done, sink) = sides(DEFAULT_BUDGET, n);
        assert!(!done.spilled());
        let repeats = done
            .compare(&sink, |id| missing.push(id), |id| unknown.push(id))
            .unwrap();
        let want = |keep: fn(u32) -> bool| {
            let mut v: Vec<String> = (0..n)
                .filter(|&i| keep(i))
                .map(|i| if i % 7 == 0 { format!("row-{i}") } else { hex_id(i) })
                .collect();
            v.sort();
            v
        };
        missing.sort();
        unknown.sort();
        // Done holds i unless i % 101 == 3 (but i % 83 == 2 pushes it again); the
        // sink holds i unless i % 97 == 5 (but i % 89 == 1 pushes it again).
        fn done_has(i: u32) -> bool {
            i % 101 != 3 || i % 83 == 2
        }
        fn sink_has(i: u32) -> bool {
            i % 97 != 5 || i % 89 == 1
        }
        assert_eq!(missing, want(|i| done_has(i) && !sink_has(i)));
        assert_eq!(
            unknown,
            [vec![String::new()], want(|i| !done_has(i) && sink_has(i))].concat()
        );
        let twice =
            |dup: fn(u32) -> bool, first: fn(u32) -> bool| (0..n).filter(|&i| dup(i) && first(i)).count() as u64;
        assert_eq!(
            repeats,
            (
                twice(|i| i % 83 == 2, |i| i % 101 != 3),
                twice(|i| i % 89 == 1, |i| i % 97 != 5)
            )
        );
        assert!(!missing.is_empty() && unknown.len() > 1 && repeats.0 > 0 && repeats.1 > 0);

        // Spilled to disk many times over, the same answers.
        let (small_done, small_sink) = sides(4 << 10, n);
        assert!(small_done.spilled() && small_sink.spilled());
        let (mut m2, mut u2) = (vec![], vec![]);
        assert_eq!(
            small_done
                .compare(&small_sink, |id| m2.push(id), |id| u2.push(id))
                .unwrap(),
            repeats
        );
        m2.sort();
        u2.sort();
        assert_eq!((m2, u2), (missing, unknown));
        assert_eq!(small_sink.to_strings().unwrap(), sink.to_strings().unwrap());
        assert_eq!(small_sink.distinct().unwrap(), sink.distinct().unwrap());
        assert_eq!(sink.len(), small_sink.len());
    }

    #[test]
    fn distinct_counts_each_key_once() {
        let mut keys = RecordIds::with_budget(64);
        for i in 0u32..1000 {
            keys.push_bytes(&(i % 400).to_le_bytes());
        }
        assert!(keys.spilled());
        assert_eq!(keys.distinct().unwrap(), (400, 600));
        // A clone spilling on its own writes where the first does not read.
        let mut other = keys.clone();
        for i in 1000u32..2000 {
            other.push_bytes(&i.to_le_bytes());
        }
        assert_eq!(keys.distinct().unwrap(), (400, 600));
        assert_eq!(other.distinct().unwrap(), (1400, 600));
    }
}
