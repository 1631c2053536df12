//! Rate-limited logging for what hostile peers can trigger at will (refused writes, refused
//! connections, undecodable messages): one line per interval at most, with the count of
//! what was left out, so a flood costs a counter increment, not a log line per message.
//!
//! Hand-written rather than a crate: it is one atomic and a lock-free compare, and the
//! crates that rate-limit `tracing` filter by callsite, which would merge every peer's
//! refusals into one line without the count this keeps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Allows one event per `interval`; counts the others.
#[derive(Debug)]
pub struct LogLimiter {
    interval: Duration,
    /// Milliseconds since `epoch` at which the next line may be written.
    next_ms: AtomicU64,
    suppressed: AtomicU64,
    epoch: tokio::time::Instant,
}

impl LogLimiter {
    /// The first event is allowed at once, then one per `interval` (measured on tokio's
    /// clock, virtual under madsim).
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
        }
    }

    /// `Some(n)` when a line may be written now, `n` being how many were left out since the
    /// last one; `None` when this one should be left out (it is counted).
    pub fn allow(&self) -> Option<u64> {
        let now_ms = self.epoch.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        let until = now_ms + self.interval.as_millis() as u64;
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(next, until, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl Default for LogLimiter {
    /// One line a second.
    fn default() -> Self {
        Self::new(Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let l = LogLimiter::new(Duration::from_secs(3600));
        assert_eq!(l.allow(), Some(0));
        for _ in 0..1000 {
            assert_eq!(l.allow(), None);
        }
        let l = LogLimiter::new(Duration::ZERO);
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), Some(0));
    }
}
