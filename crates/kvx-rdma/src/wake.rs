//! How the completion poller sleeps when the queue is empty, and how a post wakes it.
//!
//! A poller that sleeps a fixed time after finding nothing would notice the completion of a
//! write posted after an idle spell up to that long late (1 ms after a second of quiet). So a
//! post records itself and unparks the poller, which then spins — yielding, never sleeping —
//! while a post is recent; idle, it parks for a while at a time, and any post ends the park
//! at once. A receiver's completions come without a post of its own: for them the idle park
//! stays short (50 µs) for a second after the last completion, then 1 ms.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long after a post the poller spins instead of sleeping: far longer than a write
/// takes, far shorter than an idle spell.
const RECENT: Duration = Duration::from_millis(20);

/// How the poller waits when it found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdleWait {
    /// The park while completions came lately.
    pub short: Duration,
    /// How long after the last completion the short park is kept.
    pub short_for: Duration,
    /// The park after that.
    pub long: Duration,
}

impl Default for IdleWait {
    fn default() -> Self {
        IdleWait {
            short: Duration::from_micros(50),
            short_for: Duration::from_secs(1),
            long: Duration::from_millis(1),
        }
    }
}

/// Shared by the poller thread and everyone who posts on its device.
#[derive(Debug)]
pub(crate) struct PollerWake {
    epoch: Instant,
    /// Nanoseconds since `epoch` of the last post (0: none yet).
    last_post: AtomicU64,
    poller: OnceLock<Thread>,
    idle: IdleWait,
}

impl Default for PollerWake {
    fn default() -> Self {
        Self::new(IdleWait::default())
    }
}

impl PollerWake {
    pub(crate) fn new(idle: IdleWait) -> Self {
        PollerWake {
            epoch: Instant::now(),
            last_post: AtomicU64::new(0),
            poller: OnceLock::new(),
            idle,
        }
    }

    /// Called once by the poller thread, so posts can unpark it.
    pub(crate) fn register_poller(&self) {
        let _ = self.poller.set(std::thread::current());
    }

    /// A work request was posted: its completion will come soon, so the poller should look.
    pub(crate) fn posted(&self) {
        let now = self.epoch.elapsed().as_nanos().max(1) as u64;
        self.last_post.store(now, Ordering::Release);
        if let Some(t) = self.poller.get() {
            t.unpark();
        }
    }

    fn posted_lately(&self) -> bool {
        let last = self.last_post.load(Ordering::Acquire);
        let now = self.epoch.elapsed().as_nanos() as u64;
        last != 0 && now.saturating_sub(last) < RECENT.as_nanos() as u64
    }

    /// The poller found nothing, `quiet` after its last completion: spin while a post is
    /// recent, else park (a post unparks it).
    pub(crate) fn wait(&self, quiet: Duration) {
        if self.posted_lately() {
            std::thread::yield_now();
        } else if quiet < self.idle.short_for {
            std::thread::park_timeout(self.idle.short);
        } else {
            std::thread::park_timeout(self.idle.long);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_post_ends_a_long_park_at_once() {
        let wake = Arc::new(PollerWake::new(IdleWait {
            short: Duration::from_secs(30),
            short_for: Duration::ZERO,
            long: Duration::from_secs(30),
        }));
        let (tx, rx) = std::sync::mpsc::channel();
        let poller = std::thread::spawn({
            let wake = wake.clone();
            move || {
                wake.register_poller();
                tx.send(()).expect("ready");
                let started = Instant::now();
                wake.wait(Duration::from_secs(5));
                started.elapsed()
            }
        });
        rx.recv().expect("registered");
        std::thread::sleep(Duration::from_millis(50));
        wake.posted();
        let parked = poller.join().expect("poller");
        assert!(
            parked < Duration::from_secs(10),
            "parked {parked:?} after a post"
        );
        // Right after a post the poller spins instead of parking.
        assert!(wake.posted_lately());
    }
}
