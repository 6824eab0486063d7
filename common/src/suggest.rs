//! What a message suggests to a person: the nearest of the names that do
//! exist to a mistyped one (a job, a template placeholder), by edit
//! distance; and the words of a suggested command, quoted for the shell.

/// Edit distance (insertions, deletions, substitutions), case-insensitive.
fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.to_lowercase().chars().collect();
    let b: Vec<char> = b.to_lowercase().chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let swap = usize::from(ca != cb);
            cur[j + 1] = (prev[j] + swap).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The name in `names` closest to `word`, when it is close enough to be
/// what was meant (at most a third of its letters, and at least two, off).
pub fn nearest<'a>(word: &str, names: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let most = (word.chars().count() / 3).max(2);
    names
        .into_iter()
        .filter(|n| *n != word)
        .map(|n| (distance(word, n), n))
        .filter(|(d, _)| *d <= most)
        .min_by_key(|(d, n)| (*d, *n))
        .map(|(_, n)| n)
}

/// A word as a POSIX shell reads it back (quoted when it needs to be).
pub fn shell_word(w: &str) -> String {
    let plain = !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+%".contains(c));
    if plain {
        w.to_owned()
    } else {
        format!("'{}'", w.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_finds_its_name_and_nonsense_finds_none() {
        let fields = ["title", "body", "message_id", "channel"];
        assert_eq!(nearest("titel", fields), Some("title"));
        assert_eq!(nearest("Channel", fields), Some("channel"));
        assert_eq!(nearest("mesage_id", fields), Some("message_id"));
        assert_eq!(nearest("price", fields), None);
        assert_eq!(nearest("title", fields), None, "the word itself is no suggestion");
        assert_eq!(distance("kitten", "sitting"), 3);
    }

    #[test]
    fn words_are_quoted_only_when_the_shell_needs_it() {
        assert_eq!(shell_word("job.toml"), "job.toml");
        assert_eq!(shell_word("my job.toml"), "'my job.toml'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
