//! The reviewer's terminal for `producer review next`: one key at a time
//! (raw mode, through crossterm), a line of text when asked (a note, a
//! reason), and the terminal put back as it was however the program ends:
//! on drop, on a panic, and when a signal cancels the loop (the key wait
//! looks at the cancellation every 100 ms). Without a terminal (input from
//! a pipe) keys are read as bytes.

use std::io::{BufRead, Read, Write};
use std::time::Duration;

use crossterm::event::{Event, KeyCode, KeyEventKind, KeyModifiers};
use tokio_util::sync::CancellationToken;

pub struct Terminal {
    raw: bool,
}

impl Terminal {
    /// Raw mode when standard input is a terminal.
    pub fn enter() -> Terminal {
        use std::io::IsTerminal;
        let raw = std::io::stdin().is_terminal() && crossterm::terminal::enable_raw_mode().is_ok();
        if raw {
            restore_on_panic();
        }
        Terminal { raw }
    }

    /// Writes text, lines ending as the terminal's mode needs.
    pub fn say(&self, text: &str) -> std::io::Result<()> {
        let text = if self.raw {
            text.replace('\n', "\r\n")
        } else {
            text.to_owned()
        };
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()
    }

    /// The next key pressed (Ctrl-C and Ctrl-D are `q`), or None when
    /// `cancel` fired (a signal) or input ended.
    pub fn key(&mut self, cancel: &CancellationToken) -> std::io::Result<Option<char>> {
        if !self.raw {
            let mut b = [0u8; 1];
            loop {
                if std::io::stdin().read(&mut b)? == 0 {
                    return Ok(None);
                }
                if !b[0].is_ascii_whitespace() {
                    return Ok(Some(b[0] as char));
                }
            }
        }
        loop {
            if cancel.is_cancelled() {
                return Ok(None);
            }
            if !crossterm::event::poll(Duration::from_millis(100))? {
                continue;
            }
            if let Event::Key(k) = crossterm::event::read()? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('c' | 'd') if k.modifiers.contains(KeyModifiers::CONTROL) => return Ok(Some('q')),
                    KeyCode::Char(c) if !c.is_whitespace() => return Ok(Some(c)),
                    _ => {}
                }
            }
        }
    }

    /// A line of text after `prompt` (typed with the terminal's own
    /// editing), without its line end; None when input ended.
    pub fn line(&mut self, prompt: &str) -> std::io::Result<Option<String>> {
        let _cooked = self.cooked();
        self.say(prompt)?;
        let mut line = String::new();
        if std::io::stdin().lock().read_line(&mut line)? == 0 {
            return Ok(None);
        }
        Ok(Some(line.trim_end_matches(['\r', '\n']).to_owned()))
    }

    /// The terminal as programs expect it (for `$EDITOR`), until the guard drops.
    pub fn cooked(&mut self) -> Cooked {
        if self.raw {
            let _ = crossterm::terminal::disable_raw_mode();
        }
        Cooked { raw: self.raw }
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        if self.raw {
            let _ = crossterm::terminal::disable_raw_mode();
        }
    }
}

/// Raw mode comes back when this drops.
pub struct Cooked {
    raw: bool,
}

impl Drop for Cooked {
    fn drop(&mut self) {
        if self.raw {
            let _ = crossterm::terminal::enable_raw_mode();
        }
    }
}

/// A panic leaves the terminal usable: raw mode off before the message.
fn restore_on_panic() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let _ = crossterm::terminal::disable_raw_mode();
            previous(info);
        }));
    });
}
