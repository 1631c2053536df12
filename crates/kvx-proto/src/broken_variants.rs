//! Deliberately broken behaviours (feature `broken-variants`), for the simulation only: a
//! checker that cannot fail proves nothing, so `sim/` turns each of these on and shows that it
//! is caught. Without the feature this module does not exist and every hook is `false`.
//!
//! The selection is per thread, because the simulation runs one seed per thread (madsim is
//! single-threaded) and tests of different variants run side by side in one binary.

use std::cell::Cell;

/// One broken behaviour. `scripts/mutants.py` applies the same breaks as source patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Variant {
    /// Admit every request without checking capacity.
    NoReservation,
    /// Release the whole reservation when the last batch is allocated (LMCache W12).
    ReleaseBeforeComplete,
    /// Let a request take staging before its receiver admitted it.
    StageBeforeAdmit,
    /// On a serial channel, send a probe while another admitted request still needs the
    /// channel (LMCache W1).
    LockAcrossAdmission,
    /// Acknowledge a CancelNotif without releasing anything.
    NoCancelRelease,
    /// Free a rolled-back request's slots at once, though a write may still land.
    ReuseSlotEarly,
    /// Never submit the pending batches (`handle_add`) when only they hold staging (S11).
    NoPendingFlush,
    /// Count a failed request as gone (`SenderFlow::is_tracked`) while its posted writes may
    /// still read the caller's staging (S13): the application takes its memory back early.
    ReleasedWhileWritesRead,
}

impl Variant {
    /// Every variant, in declaration order.
    pub const ALL: [Variant; 8] = [
        Variant::NoReservation,
        Variant::ReleaseBeforeComplete,
        Variant::StageBeforeAdmit,
        Variant::LockAcrossAdmission,
        Variant::NoCancelRelease,
        Variant::ReuseSlotEarly,
        Variant::NoPendingFlush,
        Variant::ReleasedWhileWritesRead,
    ];

    /// The name `--break` takes (and `scripts/mutants.py` uses).
    pub fn name(self) -> &'static str {
        match self {
            Variant::NoReservation => "no-reservation",
            Variant::ReleaseBeforeComplete => "release-before-complete",
            Variant::StageBeforeAdmit => "stage-before-admit",
            Variant::LockAcrossAdmission => "lock-across-admission",
            Variant::NoCancelRelease => "no-cancel-release",
            Variant::ReuseSlotEarly => "reuse-slot-early",
            Variant::NoPendingFlush => "no-pending-flush",
            Variant::ReleasedWhileWritesRead => "released-while-writes-read",
        }
    }

    /// The variant `name` names (as `name` writes it), if any.
    pub fn from_name(name: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.name() == name)
    }
}

thread_local! {
    static ACTIVE: Cell<Option<Variant>> = const { Cell::new(None) };
}

/// Selects the broken variant for the calling thread (None: the correct build).
pub fn set(variant: Option<Variant>) {
    ACTIVE.with(|a| a.set(variant));
}

/// Whether `variant` is selected on the calling thread.
pub fn active(variant: Variant) -> bool {
    ACTIVE.with(|a| a.get() == Some(variant))
}
