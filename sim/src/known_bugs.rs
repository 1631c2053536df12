//! Bugs in kvx that the simulation found. Each is worked around in the application the
//! simulation plays (never in kvx) until fixed, so that a sweep keeps testing everything
//! else; `--expose NAME` turns the workaround off to replay it. Fixed ones are listed, with
//! the scenario that guards each, in `docs/sim.md` §Findings.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KnownBug {
    /// With TP > 1 each rank's receiver admits in its own FIFO order and nothing orders
    /// admissions across ranks: two requests admitted in opposite orders at two ranks'
    /// receivers each hold one rank and wait for the other, until `admission_timeout` fails
    /// one. kvx cannot enforce an order across processes, so the protocol makes it the
    /// integration's rule (`docs/spec/protocol.md` §Tensor parallelism): admit a request's
    /// ranks in rank order before any transfers. The router follows it; exposing this makes
    /// the router admit every rank at once, to show why the rule exists.
    TpAdmissionCycle,
}

impl KnownBug {
    pub const ALL: [KnownBug; 1] = [KnownBug::TpAdmissionCycle];

    pub fn name(self) -> &'static str {
        match self {
            KnownBug::TpAdmissionCycle => "tp-admission-cycle",
        }
    }

    pub fn from_name(name: &str) -> Option<KnownBug> {
        KnownBug::ALL.into_iter().find(|b| b.name() == name)
    }
}
