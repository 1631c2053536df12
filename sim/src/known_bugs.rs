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
    /// kvx-proto `Channel::next_sendable`: on a pipelined channel, admission probes that wait
    /// at the receiver count against `inflight_max`. When the window is full of waiting
    /// probes, an admitted request's batches queue behind them, the receiver cannot free the
    /// capacity the probes wait for, and everything stalls until a lease or the admission
    /// timeout fails a request (LMCache's W1, back through the window). Workaround: every
    /// sender's `inflight_max` exceeds its engine's interleave, so probes never fill it.
    ProbeWindow,
    /// kvx-node `SenderHandle::add_receiver`: a new receiver gets `PeerId(receivers.len() + 1)`
    /// and a failed connect removes its entry, so after a failure a later receiver can get the
    /// id a pending or connected one already has. Two receivers then share one control
    /// channel and one fabric connection: a request meant for one is admitted and written by
    /// the other. Workaround: the engine connects to its receivers one at a time.
    PeerIdReuse,
    /// Protocol (design): with TP > 1 each rank's receiver admits in its own FIFO order, and
    /// nothing orders admissions across ranks. Two requests admitted in opposite orders at
    /// two ranks' receivers each hold one rank and wait for the other: a circular wait that
    /// only `admission_timeout` (a failure) or `unconsumed_ttl` breaks — and when the TTL
    /// breaks it, the proxy can still report ready a request whose first rank's KV is gone.
    /// Workaround: with TP > 1 the router admits no more chunks to a decode worker than its
    /// buffer holds (admission at the proxy), so receivers never queue.
    TpAdmissionCycle,
    /// kvx-proto `SenderFlow::handle_message` (sender/reply.rs) matches a reply to its
    /// in-flight batch without looking at the batch's deadline. A sender whose process
    /// stalls while a grant is on its way processes the reply after the stall — before its
    /// own timer would have failed the batch — and posts writes for slots the receiver
    /// reclaimed (lease) and, once the quarantine ended, granted to another request: the
    /// write lands in someone else's KV. Workaround: process hangs are kept shorter than
    /// `request_idle_timeout + write_quarantine`, so a stale write lands in quarantine.
    StaleGrant,
}

impl KnownBug {
    pub const ALL: [KnownBug; 5] = [
        KnownBug::AllocateWakeup,
        KnownBug::ProbeWindow,
        KnownBug::PeerIdReuse,
        KnownBug::TpAdmissionCycle,
        KnownBug::StaleGrant,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KnownBug::AllocateWakeup => "allocate-wakeup",
            KnownBug::ProbeWindow => "probe-window",
            KnownBug::PeerIdReuse => "peer-id-reuse",
            KnownBug::TpAdmissionCycle => "tp-admission-cycle",
            KnownBug::StaleGrant => "stale-grant",
        }
    }

    pub fn from_name(name: &str) -> Option<KnownBug> {
        KnownBug::ALL.into_iter().find(|b| b.name() == name)
    }
}

/// Applies the workarounds that are configuration (the rest live in the engine).
pub fn apply(cfg: &mut crate::SimConfig, exposed: &[KnownBug]) {
    if !exposed.contains(&KnownBug::StaleGrant) {
        let shortest = cfg.decode.iter().map(|d| d.receiver.request_idle_timeout + d.receiver.write_quarantine).min();
        let cap = shortest.unwrap_or_default().mul_f64(0.9);
        for f in &mut cfg.faults {
            if let crate::config::Fault::Pause { lasts, .. } = &mut f.fault {
                *lasts = (*lasts).min(cap);
            }
        }
    }
    if !exposed.contains(&KnownBug::ProbeWindow) {
        for p in &mut cfg.prefill {
            p.sender.inflight_max = p.sender.inflight_max.max(p.interleave + 1);
        }
    }
}
