//! Many record ids held in little memory: 32 bytes for the 64 lowercase hex
//! digits every id batchfleet makes is (a `String` of one takes about 90),
//! the text for anything else. `status --require-complete` holds the done
//! records' ids and the sink's this way to compare them.

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

/// A multiset of record ids. [`sort`](Self::sort) before comparing or
/// looking one up: both halves are then in the order of the ids' text (the
/// bytes of lowercase hex sort as its text does).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordIds {
    hex: Vec<[u8; 32]>,
    other: Vec<String>,
}

impl RecordIds {
    pub fn with_capacity(n: usize) -> RecordIds {
        RecordIds {
            hex: Vec::with_capacity(n),
            other: Vec::new(),
        }
    }

    pub fn push(&mut self, id: &str) {
        match id_bytes(id.as_bytes()) {
            Some(b) => self.hex.push(b),
            None => self.other.push(id.to_owned()),
        }
    }

    pub fn len(&self) -> usize {
        self.hex.len() + self.other.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn sort(&mut self) {
        self.hex.sort_unstable();
        self.other.sort_unstable();
    }

    /// Removes repeats (sorted first); returns how many there were.
    pub fn dedup(&mut self) -> usize {
        let before = self.len();
        self.hex.dedup();
        self.other.dedup();
        before - self.len()
    }

    /// Whether `id` is held (sorted first).
    pub fn contains(&self, id: &str) -> bool {
        match id_bytes(id.as_bytes()) {
            Some(b) => self.hex.binary_search(&b).is_ok(),
            None => self.other.binary_search_by(|o| o.as_str().cmp(id)).is_ok(),
        }
    }

    /// Every id as text, in the text's order (sorted first).
    pub fn to_strings(&self) -> Vec<String> {
        let mut all: Vec<String> = self
            .hex
            .iter()
            .map(hex::encode)
            .chain(self.other.iter().cloned())
            .collect();
        all.sort_unstable();
        all
    }

    /// One merge of two sorted sets: `only_here` gets each id of `self` that
    /// `other` lacks, `only_there` each of `other`'s that `self` lacks.
    pub fn diff(&self, other: &RecordIds, mut only_here: impl FnMut(String), mut only_there: impl FnMut(String)) {
        merge(
            &self.hex,
            &other.hex,
            |b| only_here(hex::encode(b)),
            |b| only_there(hex::encode(b)),
        );
        merge(
            &self.other,
            &other.other,
            |s| only_here(s.clone()),
            |s| only_there(s.clone()),
        );
    }
}

impl<'a> FromIterator<&'a str> for RecordIds {
    /// The ids, sorted.
    fn from_iter<I: IntoIterator<Item = &'a str>>(ids: I) -> RecordIds {
        let mut all = RecordIds::default();
        ids.into_iter().for_each(|id| all.push(id));
        all.sort();
        all
    }
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

    fn hex_id(n: u8) -> String {
        format!("{:064x}", u128::from(n) << 100)
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
        let mut ids = RecordIds::default();
        for id in [id.as_str(), "r2", "r1"] {
            ids.push(id);
        }
        ids.sort();
        assert_eq!(ids.to_strings(), [id.clone(), "r1".into(), "r2".into()]);
        assert!(ids.contains(&id) && ids.contains("r1") && !ids.contains("r3") && !ids.contains(&hex_id(1)));
    }

    #[test]
    fn repeats_are_counted_and_one_merge_finds_what_each_side_lacks() {
        let mut done = RecordIds::default();
        for id in [hex_id(1), hex_id(2), hex_id(3), "x".into(), "y".into()] {
            done.push(&id);
        }
        let mut sink = RecordIds::default();
        for id in [hex_id(3), hex_id(2), hex_id(3), hex_id(4), "y".into(), "z".into()] {
            sink.push(&id);
        }
        done.sort();
        sink.sort();
        assert_eq!(sink.dedup(), 1);
        assert_eq!(sink.len(), 5);
        let (mut missing, mut unknown) = (vec![], vec![]);
        done.diff(&sink, |id| missing.push(id), |id| unknown.push(id));
        assert_eq!(missing, [hex_id(1), "x".into()]);
        assert_eq!(unknown, [hex_id(4), "z".into()]);
    }
}
