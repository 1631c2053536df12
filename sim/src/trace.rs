//! The event trace: every observable step of a run (a message delivered or dropped, a write
//! landed or flushed, a fault, a request's end) as one line, hashed as it goes. Two runs of
//! one seed must give the same hash; the last lines are kept for the failure report.

use std::collections::VecDeque;
use std::fmt::Write;
use std::time::Duration;

/// Lines kept for a failure report.
const TAIL_LINES: usize = 60;

#[derive(Debug)]
pub struct Trace {
    hash: u64,
    events: u64,
    tail: VecDeque<String>,
    /// Print every line to stderr as it happens (`--trace`).
    pub print: bool,
}

impl Default for Trace {
    fn default() -> Self {
        Self {
            hash: 0xcbf2_9ce4_8422_2325,
            events: 0,
            tail: VecDeque::new(),
            print: false,
        }
    }
}

impl Trace {
    pub fn record(&mut self, now: Duration, what: std::fmt::Arguments<'_>) {
        let mut line = String::with_capacity(64);
        let _ = write!(line, "{:>12.9} {what}", now.as_secs_f64());
        // FNV-1a over the line: cheap, and stable across platforms and runs.
        for b in line.bytes() {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        self.events += 1;
        if self.print {
            eprintln!("{line}");
        }
        if self.tail.len() == TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(line);
    }

    pub fn hash(&self) -> u64 {
        self.hash
    }

    pub fn events(&self) -> u64 {
        self.events
    }

    pub fn tail(&self) -> impl Iterator<Item = &String> {
        self.tail.iter()
    }
}
