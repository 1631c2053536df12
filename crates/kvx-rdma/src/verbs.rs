//! The seam between kvx's RDMA logic and the verbs library: a device (`Verbs`) that registers
//! memory, creates queue pairs and polls its completion queue, and a queue pair (`VerbsQp`)
//! that changes state and posts work requests. `ibv` implements it over sideway (feature
//! `rdma`); the tests implement it with an in-process model (`fake`), so that everything above
//! these calls — queue pair states, completion routing, flushing, the side channel — is
//! tested without hardware.
//!
//! `Qp` wraps a `VerbsQp` with the state machine of an RC queue pair
//! (RESET → INIT → RTR → RTS, and ERROR from anywhere), so that a transition out of order is
//! refused here, with a clear error, before it reaches the driver.

use std::fmt;
use std::sync::Arc;

use crate::memory::RdmaMemory;
use crate::wire::{GidKind, QpAddr};

// The seam's vocabulary, defined where `memory` can import it without importing this module
// (which names `RdmaMemory`): `MrKeys` beside the memory that keeps them, `VerbsError` and
// `RemoteAccess` in leaves.
pub use crate::limits::DeviceLimits;
pub use crate::memory::MrKeys;
pub use crate::remote_access::RemoteAccess;
pub use crate::verbs_error::VerbsError;

/// How a work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    /// Flushed because the queue pair is in the error state (`IBV_WC_WR_FLUSH_ERR`).
    Flushed,
    /// Any other failure: the verbs status code, its name, and the vendor's error.
    Failed {
        code: u32,
        name: &'static str,
        vendor: u32,
    },
}

/// The name of a verbs work completion status (`ibv_wc_status_str`).
pub fn wc_status_name(code: u32) -> &'static str {
    const NAMES: [&str; 22] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "work request flushed",
        "memory window bind error",
        "bad response",
        "local access error",
        "remote invalid request",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation",
        "remote invalid RD request",
        "remote aborted",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout",
        "general error",
    ];
    NAMES
        .get(code as usize)
        .copied()
        .unwrap_or("unknown status")
}

/// What a successful completion was (meaningless for failed ones, as in verbs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcKind {
    /// A local RDMA write finished.
    Write,
    /// A write with immediate consumed a posted receive: its immediate, and how many bytes
    /// the write carried.
    RecvImm { imm: u32, byte_len: u32 },
    /// Anything else (a failed completion, an opcode kvx does not post).
    Other,
}

/// One work completion, as the poller hands it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub kind: WcKind,
}

/// One RDMA WRITE (with immediate when `imm` is set) of `len` bytes of staging slot
/// `local_slot` to `remote_addr` under `rkey`.
#[derive(Debug, Clone, Copy)]
pub struct WriteWr<'a> {
    pub wr_id: u64,
    pub staging: &'a RdmaMemory,
    pub local_slot: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: Option<u32>,
}

/// The port this device's queue pairs use, as peers must address it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    pub lid: u16,
    pub gid: [u8; 16],
    /// Active MTU, as the verbs code (1 = 256 … 5 = 4096).
    pub mtu: u8,
    /// The kind of `gid`.
    pub gid_kind: GidKind,
}

/// An opened RDMA device: protection domain, one completion queue, a port.
pub trait Verbs: fmt::Debug + Send + Sync + 'static {
    type Qp: VerbsQp;

    /// Distinguishes devices (protection domains) in this process, so that staging registered
    /// with one fabric is not posted on another's queue pairs.
    fn device_id(&self) -> u64;

    /// The port as new connections advertise it: read at open, read again by
    /// `refresh_port` after an event that changes it.
    fn port(&self) -> PortInfo;

    /// Reads the port's LID, GID (at the index chosen at open) and MTU again, after a
    /// LID_CHANGE, GID_CHANGE or SM_CHANGE, so that new connections advertise what is true;
    /// existing queue pairs keep the path they were connected with.
    fn refresh_port(&self) -> Result<PortInfo, VerbsError>;

    /// The device's limits that a geometry can exceed (read when it opened).
    fn limits(&self) -> DeviceLimits;

    /// Registers `memory` for local access and, with `RemoteAccess::Write`, for peers' RDMA
    /// writes; the registration lives (and keeps the protection domain alive) as long as the
    /// memory.
    fn register(&self, memory: &Arc<RdmaMemory>, access: RemoteAccess) -> Result<(), VerbsError>;

    /// A reliable-connected queue pair in RESET whose work completions go to this device's
    /// completion queue. Fails when the device cannot take one more (the completion queue
    /// must hold every outstanding work request of every queue pair).
    fn create_qp(&self, send_depth: u32, recv_depth: u32) -> Result<Self::Qp, VerbsError>;

    /// The device's next asynchronous event, waiting at most `wait` for one (acknowledged
    /// before it is returned); `EventWait::Gone` once the device's event channel reports an
    /// error (the device was removed or reset: `poll` says POLLERR at once, ever after).
    fn next_event(&self, wait: std::time::Duration) -> EventWait;

    /// Moves the completions now in the completion queue into `out`, at most `max` of them
    /// (the rest wait for the next poll), so that a busy queue cannot keep the poller from
    /// handing on what it has.
    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<(), VerbsError>;
}

/// An asynchronous event of the device (`ibv_get_async_event`), as kvx acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The completion queue failed (overrun): no connection's completions can be trusted.
    CqError,
    /// A queue pair hit an error no work completion reports.
    QpFatal { qpn: u32 },
    /// A queue pair's peer sent a request it could not take (QP_REQ_ERR: a transport error
    /// on the responder side); the queue pair is in ERROR.
    QpRequestError { qpn: u32 },
    /// A peer's request broke the queue pair's access rules (QP_ACCESS_ERR: a write outside
    /// a registration or with a wrong key); the queue pair is in ERROR.
    QpAccessError { qpn: u32 },
    /// The device failed: nothing on it works any more.
    DeviceFatal,
    /// A port went down.
    PortError { port: u32 },
    /// A port came up.
    PortActive { port: u32 },
    /// A port's GID table changed (an address moved).
    GidChange { port: u32 },
    /// A port's LID changed (InfiniBand: the subnet manager gave it another).
    LidChange { port: u32 },
    /// A port's subnet manager changed (InfiniBand): LIDs may follow.
    SmChange { port: u32 },
    /// Any other event, by its verbs number.
    Other(u32),
}

/// What waiting for the device's next asynchronous event gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventWait {
    Event(DeviceEvent),
    /// None came within the wait.
    Quiet,
    /// The event channel failed: the device is gone (removed, or reset after a fatal
    /// error), and no event will come; why, for the log and for refusals.
    Gone(String),
}

impl DeviceEvent {
    /// The queue pair it puts in ERROR, and why, when it is about one.
    pub fn broken_qp(&self) -> Option<(u32, &'static str)> {
        match *self {
            DeviceEvent::QpFatal { qpn } => Some((qpn, "QP_FATAL")),
            DeviceEvent::QpRequestError { qpn } => Some((qpn, "QP_REQ_ERR")),
            DeviceEvent::QpAccessError { qpn } => Some((qpn, "QP_ACCESS_ERR")),
            _ => None,
        }
    }

    /// Why it breaks every connection and the fabric, when it does.
    pub fn fatal_to_the_device(&self) -> Option<&'static str> {
        match self {
            DeviceEvent::CqError => Some("the completion queue failed (CQ_ERR)"),
            DeviceEvent::DeviceFatal => Some("the device failed (DEVICE_FATAL)"),
            _ => None,
        }
    }
}

/// The peer and path settings for RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrParams {
    pub remote: QpAddr,
    /// Path MTU, as the verbs code.
    pub mtu: u8,
}

/// A state change of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// RESET → INIT, with the access peers get through it.
    Init(RemoteAccess),
    /// INIT → RTR: connect to the peer.
    Rtr(RtrParams),
    /// RTR → RTS, starting at our own PSN.
    Rts { psn: u32 },
    /// Any → ERROR: every outstanding work request completes with `WcStatus::Flushed`, and
    /// as a responder the queue pair accepts no more writes.
    Error,
}

/// One queue pair.
pub trait VerbsQp: fmt::Debug + Send + 'static {
    fn qpn(&self) -> u32;
    fn modify(&mut self, to: Transition) -> Result<(), VerbsError>;
    fn post_write(&mut self, wr: &WriteWr<'_>) -> Result<(), VerbsError>;
    /// Posts one receive without a buffer: what a write with immediate consumes.
    fn post_recv(&mut self, wr_id: u64) -> Result<(), VerbsError>;
}

/// The states of an RC queue pair that kvx uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

impl QpState {
    /// The state `to` leads to from `self`, or None when verbs would refuse it.
    pub fn after(self, to: &Transition) -> Option<QpState> {
        match (self, to) {
            (_, Transition::Error) => Some(QpState::Error),
            (QpState::Reset, Transition::Init(_)) => Some(QpState::Init),
            (QpState::Init, Transition::Rtr(_)) => Some(QpState::Rtr),
            (QpState::Rtr, Transition::Rts { .. }) => Some(QpState::Rts),
            _ => None,
        }
    }
}

/// A queue pair with its state tracked: transitions out of order and posts in the wrong
/// state are refused before reaching verbs.
#[derive(Debug)]
pub struct Qp<Q: VerbsQp> {
    /// Always `Some` until the queue pair is destroyed, in `drop`, off the runtime.
    inner: Option<Q>,
    state: QpState,
}

impl<Q: VerbsQp> Drop for Qp<Q> {
    /// `ibv_destroy_qp` waits for the device: off the runtime's workers.
    fn drop(&mut self) {
        let inner = self.inner.take();
        crate::blocking::off_the_runtime(|| drop(inner));
    }
}

impl<Q: VerbsQp> Qp<Q> {
    pub fn new(inner: Q) -> Self {
        Qp {
            inner: Some(inner),
            state: QpState::Reset,
        }
    }

    fn q(&self) -> &Q {
        self.inner
            .as_ref()
            .expect("invariant: a queue pair is destroyed only when dropped")
    }

    fn q_mut(&mut self) -> &mut Q {
        self.inner
            .as_mut()
            .expect("invariant: a queue pair is destroyed only when dropped")
    }

    pub fn state(&self) -> QpState {
        self.state
    }

    pub fn qpn(&self) -> u32 {
        self.q().qpn()
    }

    pub fn modify(&mut self, to: Transition) -> Result<(), VerbsError> {
        let Some(next) = self.state.after(&to) else {
            return Err(VerbsError::new(
                "modify_qp",
                format!("{to:?} is not a transition from {:?}", self.state),
            ));
        };
        // Every transition is a firmware command: off the runtime's workers.
        let inner = self.q_mut();
        match crate::blocking::off_the_runtime(|| inner.modify(to)) {
            Ok(()) => {
                self.state = next;
                Ok(())
            }
            Err(e) => {
                // A failed move to ERROR leaves the state unknown; the queue pair is not used
                // again either way.
                if matches!(to, Transition::Error) {
                    self.state = QpState::Error;
                }
                Err(e)
            }
        }
    }

    /// Moves to ERROR unless already there. Idempotent; failures are logged, since the caller
    /// abandons the queue pair either way.
    pub fn move_to_error(&mut self) {
        if self.state != QpState::Error {
            if let Err(e) = self.modify(Transition::Error) {
                tracing::warn!(qpn = self.qpn(), error = %e, "cannot move the queue pair to error");
            }
        }
    }

    /// Writes are posted only in RTS.
    pub fn post_write(&mut self, wr: &WriteWr<'_>) -> Result<(), VerbsError> {
        if self.state != QpState::Rts {
            return Err(VerbsError::new(
                "post_send",
                format!("the queue pair is in {:?}, not RTS", self.state),
            ));
        }
        self.q_mut().post_write(wr)
    }

    #[cfg(test)]
    pub(crate) fn inner_for_tests(&self) -> &Q {
        self.q()
    }

    #[cfg(test)]
    pub(crate) fn inner_mut_for_tests(&mut self) -> &mut Q {
        self.q_mut()
    }

    /// Receives may be posted from INIT on (before the peer can write), not after an error.
    pub fn post_recv(&mut self, wr_id: u64) -> Result<(), VerbsError> {
        if matches!(self.state, QpState::Reset | QpState::Error) {
            return Err(VerbsError::new(
                "post_recv",
                format!("the queue pair is in {:?}", self.state),
            ));
        }
        self.q_mut().post_recv(wr_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default)]
    struct Recorder {
        calls: Vec<String>,
        fail_next: bool,
    }

    impl VerbsQp for Recorder {
        fn qpn(&self) -> u32 {
            1
        }
        fn modify(&mut self, to: Transition) -> Result<(), VerbsError> {
            self.calls.push(format!("{to:?}"));
            if std::mem::take(&mut self.fail_next) {
                return Err(VerbsError::new("modify_qp", "injected"));
            }
            Ok(())
        }
        fn post_write(&mut self, wr: &WriteWr<'_>) -> Result<(), VerbsError> {
            self.calls.push(format!("write {}", wr.wr_id));
            Ok(())
        }
        fn post_recv(&mut self, wr_id: u64) -> Result<(), VerbsError> {
            self.calls.push(format!("recv {wr_id}"));
            Ok(())
        }
    }

    fn rtr() -> Transition {
        Transition::Rtr(RtrParams {
            remote: QpAddr::default(),
            mtu: 3,
        })
    }

    #[test]
    fn status_names() {
        assert_eq!(wc_status_name(12), "transport retry counter exceeded");
        assert_eq!(wc_status_name(5), "work request flushed");
        assert_eq!(wc_status_name(999), "unknown status");
    }

    #[test]
    fn the_rc_ladder_in_order_only() {
        let mut qp = Qp::new(Recorder::default());
        assert!(qp.modify(rtr()).is_err(), "RESET → RTR is refused");
        assert!(qp.post_recv(1).is_err(), "no receives in RESET");
        qp.modify(Transition::Init(RemoteAccess::Write))
            .expect("init");
        qp.post_recv(1).expect("receives from INIT on");
        assert!(qp.modify(Transition::Rts { psn: 0 }).is_err(), "INIT → RTS");
        qp.modify(rtr()).expect("rtr");
        let mem = RdmaMemory::anonymous(kvx_io::SlotGeometry::new(1, 8).expect("a geometry"))
            .expect("memory");
        let wr = WriteWr {
            wr_id: 9,
            staging: &mem,
            local_slot: 0,
            len: 8,
            remote_addr: 0,
            rkey: 0,
            imm: None,
        };
        assert!(qp.post_write(&wr).is_err(), "no writes before RTS");
        qp.modify(Transition::Rts { psn: 0 }).expect("rts");
        qp.post_write(&wr).expect("write in RTS");
        qp.move_to_error();
        qp.move_to_error();
        assert_eq!(qp.state(), QpState::Error);
        assert!(qp.post_write(&wr).is_err(), "no writes after an error");
        assert!(qp.post_recv(2).is_err(), "no receives after an error");
        assert_eq!(
            qp.q()
                .calls
                .iter()
                .filter(|c| c.as_str() == "Error")
                .count(),
            1,
            "to_error is idempotent: {:?}",
            qp.q().calls
        );
    }

    #[test]
    fn a_failed_transition_keeps_the_state_but_a_failed_error_is_final() {
        let mut qp = Qp::new(Recorder::default());
        qp.q_mut().fail_next = true;
        assert!(qp.modify(Transition::Init(RemoteAccess::Write)).is_err());
        assert_eq!(qp.state(), QpState::Reset);
        qp.q_mut().fail_next = true;
        qp.move_to_error();
        assert_eq!(qp.state(), QpState::Error);
    }
}
