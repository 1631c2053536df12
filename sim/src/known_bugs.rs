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
    /// kvx-node's sender driver replaces its fabric connection to a receiver only when a
    /// write stalls (`FabricStalled`) or the control channel reconnects. A connection that
    /// errors by itself while the control channel stays up — the NIC gave up on a write
    /// (retry count exceeded) while the sender process hung, so no write timeout fired — is
    /// never replaced: every later write to that receiver fails, for good. Workaround: when a
    /// queue pair errors by itself, the simulated link flap also resets the pair's control
    /// connection, whose `Reconnected` makes the driver replace the fabric connection.
    FabricNotReplaced,
}

impl KnownBug {
    pub const ALL: [KnownBug; 2] = [KnownBug::TpAdmissionCycle, KnownBug::FabricNotReplaced];

    pub fn name(self) -> &'static str {
        match self {
            KnownBug::TpAdmissionCycle => "tp-admission-cycle",
            KnownBug::FabricNotReplaced => "fabric-not-replaced",
        }
    }

    pub fn from_name(name: &str) -> Option<KnownBug> {
        KnownBug::ALL.into_iter().find(|b| b.name() == name)
    }
}
