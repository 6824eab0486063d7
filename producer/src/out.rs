//! Standard output that survives a closed pipe: `producer status | head -3`
//! or `review list | true` ends quietly with exit code 141 (as a command
//! killed by SIGPIPE does), never with a panic.

use std::fmt;
use std::io::Write;

/// The exit code when the reader of standard output went away.
pub const EXIT_CLOSED_PIPE: u8 = 141;

/// Writes one line to standard output.
pub fn write_line(args: fmt::Arguments<'_>) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = writeln!(o, "{args}") {
        closed(&e);
    }
}

/// Writes to standard output without a newline, and flushes.
pub fn write(args: fmt::Arguments<'_>) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_fmt(args).and_then(|()| o.flush()) {
        closed(&e);
    }
}

fn closed(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        common::log::flush(std::time::Duration::from_secs(1));
        std::process::exit(i32::from(EXIT_CLOSED_PIPE));
    }
    common::errln!("error: cannot write to standard output: {e}");
    common::log::flush(std::time::Duration::from_secs(1));
    std::process::exit(1);
}

/// Whether an error is (caused by) a closed pipe.
pub fn is_closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    }) || e.to_string().contains("Broken pipe")
}

/// `println!` that ends quietly on a closed pipe.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::out::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::out::write_line(format_args!($($arg)*))
    };
}

/// `print!` (flushed) that ends quietly on a closed pipe.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}
