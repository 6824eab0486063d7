//! Reads a JSONL dataset line by line in flat memory, with byte offsets.
//!
//! A line longer than the limit is skipped to its end without being buffered,
//! so one huge line cannot blow up the producer's memory.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use sha2::{Digest, Sha256};

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Where a line was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinePos {
    /// 1-based line number.
    pub number: u64,
    /// Byte offset just after this line (and its `\n`): the resume point.
    pub end: u64,
    /// The line's real length when it was over the limit and not buffered.
    pub oversize: Option<u64>,
}

pub struct LineReader {
    inner: BufReader<io::Take<File>>,
    offset: u64,
    number: u64,
    limit: usize,
}

impl LineReader {
    /// Opens `path` positioned at `offset`, which is the start of line `line + 1`.
    pub fn open(path: &Path, offset: u64, line: u64, limit: usize) -> io::Result<LineReader> {
        Self::open_until(path, offset, line, limit, u64::MAX)
    }

    /// [`LineReader::open`], reading no further than byte `end` (what was
    /// hashed: a file that grows meanwhile is read only as far as its hash).
    pub fn open_until(path: &Path, offset: u64, line: u64, limit: usize, end: u64) -> io::Result<LineReader> {
        let mut file = File::open(path)?;
        file.seek(SeekFrom::Start(offset))?;
        Ok(LineReader {
            inner: BufReader::with_capacity(256 * 1024, file.take(end.saturating_sub(offset))),
            offset,
            number: line,
            limit,
        })
    }

    /// Reads the next line into `buf` (without `\n`). `None` at end of file.
    pub fn next_line(&mut self, buf: &mut Vec<u8>) -> io::Result<Option<LinePos>> {
        buf.clear();
        let start = self.offset;
        let mut len: u64 = 0;
        let mut over = false;
        let mut saw_any = false;
        loop {
            let chunk = self.inner.fill_buf()?;
            if chunk.is_empty() {
                break;
            }
            saw_any = true;
            let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (i, true),
                None => (chunk.len(), false),
            };
            len += take as u64;
            if !over {
                if buf.len() + take > self.limit {
                    over = true;
                    buf.clear();
                } else {
                    buf.extend_from_slice(&chunk[..take]);
                }
            }
            let consumed = if done { take + 1 } else { take };
            self.inner.consume(consumed);
            self.offset += consumed as u64;
            if done {
                break;
            }
        }
        if !saw_any {
            return Ok(None);
        }
        self.number += 1;
        if start == 0 && buf.starts_with(UTF8_BOM) {
            buf.drain(..UTF8_BOM.len());
        }
        Ok(Some(LinePos {
            number: self.number,
            end: self.offset,
            oversize: over.then_some(len),
        }))
    }
}

/// sha256 of a file's first `len` bytes, streamed.
pub fn prefix_sha256(path: &Path, len: u64) -> io::Result<String> {
    let mut file = File::open(path)?.take(len);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// sha256 and size of a whole file, streamed.
pub fn file_sha256(path: &Path) -> io::Result<(String, u64)> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_tmp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("bf-reader-{}-{name}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.write_all(bytes).unwrap();
        path
    }

    fn read_all(path: &Path, offset: u64, line: u64, limit: usize) -> Vec<(LinePos, Vec<u8>)> {
        let mut r = LineReader::open(path, offset, line, limit).unwrap();
        let mut out = Vec::new();
        let mut buf = Vec::new();
        while let Some(pos) = r.next_line(&mut buf).unwrap() {
            out.push((pos, buf.clone()));
        }
        out
    }

    #[test]
    fn lines_offsets_bom_and_missing_final_newline() {
        let path = write_tmp("basic", b"\xEF\xBB\xBFab\r\n\ncde");
        let lines = read_all(&path, 0, 0, 100);
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].1, b"ab\r");
        assert_eq!(lines[0].0.end, 7);
        assert_eq!(lines[1].1, b"");
        assert_eq!(
            lines[2],
            (
                LinePos {
                    number: 3,
                    end: 11,
                    oversize: None
                },
                b"cde".to_vec()
            )
        );
        // Resuming at a line's end offset continues with the next line number.
        let resumed = read_all(&path, 7, 1, 100);
        assert_eq!(resumed[0].0.number, 2);
        assert_eq!(resumed[1].1, b"cde");
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn an_oversized_line_is_measured_not_buffered() {
        let mut data = vec![b'x'; 10_000];
        data.extend_from_slice(b"\nok\n");
        let path = write_tmp("big", &data);
        let lines = read_all(&path, 0, 0, 100);
        assert_eq!(lines[0].0.oversize, Some(10_000));
        assert!(lines[0].1.is_empty());
        assert_eq!(lines[1].1, b"ok");
        assert_eq!(lines[1].0.number, 2);
        std::fs::remove_file(path).ok();
    }
}
