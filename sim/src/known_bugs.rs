//! Bugs in kvx that the simulation found and works around until they are fixed, so that a
//! sweep keeps testing everything else. Each workaround is in the application the simulation
//! plays (the prefill engine), never in kvx; `--expose NAME` turns it off to replay the bug.
//! Each is described, with a seed that shows it, in `docs/sim.md` §Findings.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KnownBug {
    /// kvx-node `SenderHandle::allocate` (and `allocate_blocking`) wait for a core *event*;
    /// a write completion frees staging but emits none, so a waiter is not woken and waits
    /// out `staging_timeout`. Workaround: the engine re-polls `allocate` every millisecond.
    AllocateWakeup,
}

impl KnownBug {
    pub const ALL: [KnownBug; 1] = [KnownBug::AllocateWakeup];

    pub fn name(self) -> &'static str {
        match self {
            KnownBug::AllocateWakeup => "allocate-wakeup",
        }
    }

    pub fn from_name(name: &str) -> Option<KnownBug> {
        KnownBug::ALL.into_iter().find(|b| b.name() == name)
    }
}
