//! Virtual time. The core never reads a clock: every `handle_*` takes `now`, an `Instant`
//! measured from an epoch the driver chooses (process start, or zero in a simulation).

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time as the time since the driver's epoch. Adding saturates, and subtracting a
/// later instant gives zero, so no arithmetic on deadlines panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(Duration);

impl Instant {
    /// The epoch.
    pub const ZERO: Instant = Instant(Duration::ZERO);

    /// The instant `since_epoch` after the epoch.
    pub fn from_duration(since_epoch: Duration) -> Self {
        Instant(since_epoch)
    }

    /// The time since the epoch.
    pub fn since_epoch(self) -> Duration {
        self.0
    }

    /// The time from `earlier` to `self`; zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(d))
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, earlier: Instant) -> Duration {
        self.saturating_since(earlier)
    }
}

/// The earlier of two optional deadlines.
pub fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}
