//! An in-process model of an RDMA NIC behind the `Verbs` seam, for tests: every queue pair of
//! one `FakeVerbs` — and of the other devices made with `another_device`, each with its own
//! completion queue and port — is on one loopback "wire". It keeps what kvx relies on from RC
//! verbs:
//! - a write is applied when its target queue pair is connected back to it (RTR/RTS) and the
//!   remote key and range are valid, else it fails and the requester goes to ERROR;
//! - a write with immediate consumes one posted receive of the target, whose completion
//!   carries the immediate and follows the data; with none posted the write waits (RNR), and
//!   so does everything behind it on that queue pair;
//! - completions come in posting order per queue pair; ERROR flushes every outstanding work
//!   request (`WcStatus::Flushed`) and a responder in ERROR accepts nothing;
//! - a write of more than one packet between two queue pairs whose path MTUs differ is
//!   rejected by the responder ("remote invalid request", and the requester goes to ERROR):
//!   a responder checks every packet's length against its own path MTU (IBA C9-92; rxe's
//!   `check_length`), so both ends of a connection must agree on it.
//!
//! - a write needs remote write access on both the responder's queue pair and the target's
//!   registration (`RemoteAccess`), else it fails with "remote access error";
//! - packets between devices whose GIDs are of different kinds (`with_gid_kind`: RoCE v1
//!   and v2) are not understood: the write ends in "retry counter exceeded";
//! - destroying a queue pair purges its completions not yet polled (as mlx5 does), and a
//!   device's completions can be held back from its poller (`hold_completions`) to open
//!   that window in a test;
//! - the verbs calls that block on hardware (`ibv_reg_mr`, `ibv_create_qp`, RTR,
//!   `ibv_destroy_qp`) can be made to take a while (`with_slow_verbs`);
//! - a device's limits (`with_limits`) fail as a driver does: a registration beyond
//!   `max_mr_size` or a queue deeper than `max_qp_wr` with an opaque "Invalid argument", a
//!   write beyond `max_msg_sz` with a "local length error" completion.
//!
//! Faults: `fail_write_after(n)` fails the (n+1)-th write from now with "retry counter
//! exceeded", as a link going down would; `corrupt_write_after(n, k)` flips byte `k` of the
//! (n+1)-th write from now once it landed, as memory or a DMA path past the link's CRC could:
//! the write succeeds, and only kvx's checksum can tell.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use kvx_io::SlotMemory;

use crate::memory::RdmaMemory;
use crate::verbs::{
    DeviceEvent, DeviceLimits, EventWait, MrKeys, PortInfo, QpState, RemoteAccess, Transition,
    Verbs, VerbsError, VerbsQp, Wc, WcKind, WcStatus, WriteWr,
};
use crate::wire::GidKind;

const RETRY_EXCEEDED: WcStatus = WcStatus::Failed {
    code: 12,
    name: "transport retry counter exceeded",
    vendor: 0,
};
const REMOTE_ACCESS: WcStatus = WcStatus::Failed {
    code: 10,
    name: "remote access error",
    vendor: 0,
};
const LOCAL_LENGTH: WcStatus = WcStatus::Failed {
    code: 1,
    name: "local length error",
    vendor: 0,
};
const REMOTE_INVALID_REQUEST: WcStatus = WcStatus::Failed {
    code: 9,
    name: "remote invalid request",
    vendor: 0,
};

/// One device on the model's wire: its own completion queue and port.
#[derive(Debug, Clone)]
pub(crate) struct FakeVerbs {
    wire: Arc<Wire>,
    id: u64,
    /// The port's active MTU, as the verbs code.
    port_mtu: u8,
    /// The kind of the port's GID (RoCE v2 unless `with_gid_kind`).
    gid_kind: GidKind,
    limits: DeviceLimits,
    /// How long each blocking verbs call takes (`with_slow_verbs`).
    slow: std::time::Duration,
    /// Asynchronous events waiting to be read (`inject_event`), this device's own.
    events: Arc<Mutex<VecDeque<DeviceEvent>>>,
    /// The port's addresses: as the hardware has them now (`move_port`), and as last read
    /// (`port`, refreshed by `refresh_port`).
    addresses: Arc<Mutex<PortAddresses>>,
    /// Set by `remove`: the event channel fails at once, as after a hot-unplug.
    removed: Arc<std::sync::atomic::AtomicBool>,
    /// Calls of `next_event`, to see that a removed device's event reader does not spin.
    event_waits: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy)]
struct PortAddresses {
    hardware: (u16, [u8; 16]),
    read: (u16, [u8; 16]),
}

impl Default for PortAddresses {
    fn default() -> Self {
        PortAddresses {
            hardware: (0, [0xAA; 16]),
            read: (0, [0xAA; 16]),
        }
    }
}

#[derive(Debug)]
struct Wire {
    state: Mutex<NicState>,
}

#[derive(Debug, Default)]
struct NicState {
    qps: HashMap<u32, QpModel>,
    /// Registrations by key: the memory, and whether peers may write it.
    regions: HashMap<u32, (Weak<RdmaMemory>, RemoteAccess)>,
    /// Each device's completion queue, each entry with the queue pair it belongs to.
    cqs: HashMap<u64, VecDeque<(u32, Wc)>>,
    /// Devices whose poller gets nothing for now (`hold_completions`).
    held: std::collections::HashSet<u64>,
    next_qpn: u32,
    next_key: u32,
    /// Writes left before the next one fails (`fail_write_after`).
    fail_after: Option<u64>,
    /// Writes left before the next one lands with a byte flipped, and which byte
    /// (`corrupt_write_after`).
    corrupt_after: Option<(u64, usize)>,
    writes_applied: u64,
}

#[derive(Debug)]
struct QpModel {
    /// The device it was created on: its completions go to that device's queue.
    device: u64,
    state: QpState,
    peer: Option<u32>,
    /// The path MTU it was brought to RTR with, as the verbs code.
    path_mtu: Option<u8>,
    /// What peers may do through it (set at INIT).
    remote: RemoteAccess,
    /// Its device's GID kind: packets between two kinds are not understood.
    gid_kind: GidKind,
    recvs: VecDeque<u64>,
    /// Posted writes not yet applied (waiting for a receive, or behind one that is).
    backlog: VecDeque<PendingWrite>,
}

#[derive(Debug)]
struct PendingWrite {
    wr_id: u64,
    data: Vec<u8>,
    remote_addr: u64,
    rkey: u32,
    imm: Option<u32>,
    /// Fails locally when it reaches the head of the queue (longer than `max_msg_sz`).
    local_failure: Option<WcStatus>,
}

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1 << 40);

impl FakeVerbs {
    /// A device on a wire of its own, its port's active MTU 4096.
    pub(crate) fn new() -> Self {
        FakeVerbs {
            wire: Arc::new(Wire {
                state: Mutex::new(NicState {
                    next_qpn: 0x100,
                    next_key: 0x1000,
                    ..NicState::default()
                }),
            }),
            id: NEXT_DEVICE.fetch_add(1, Ordering::Relaxed),
            port_mtu: 5,
            gid_kind: GidKind::RoceV2,
            limits: DeviceLimits::UNLIMITED,
            slow: std::time::Duration::ZERO,
            events: Arc::default(),
            addresses: Arc::default(),
            removed: Arc::default(),
            event_waits: Arc::default(),
        }
    }

    /// The port gets another LID and GID, as a subnet manager or an address change gives
    /// it; what `port` says changes only once `refresh_port` reads them.
    pub(crate) fn move_port(&self, lid: u16, gid: [u8; 16]) {
        self.addresses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .hardware = (lid, gid);
    }

    /// The device is removed (hot-unplug, or reset after DEVICE_FATAL): its event channel
    /// fails at once from now on.
    pub(crate) fn remove(&self) {
        self.removed.store(true, Ordering::Relaxed);
    }

    /// How many times `next_event` was called.
    pub(crate) fn event_waits(&self) -> u64 {
        self.event_waits.load(Ordering::Relaxed)
    }

    /// Raises an asynchronous event on this device, as the driver would.
    pub(crate) fn inject_event(&self, event: DeviceEvent) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(event);
    }

    /// The numbers of the live queue pairs of this device, in creation order.
    pub(crate) fn qpns(&self) -> Vec<u32> {
        let s = self.lock();
        let mut qpns: Vec<u32> = s
            .qps
            .iter()
            .filter(|(_, q)| q.device == self.id)
            .map(|(n, _)| *n)
            .collect();
        qpns.sort_unstable();
        qpns
    }

    /// The same device, each of its blocking verbs calls (registering and deregistering
    /// memory, creating a queue pair, every transition of one, destroying it) taking `slow`,
    /// as pinning a large buffer, a firmware command or resolving an address does on hardware.
    pub(crate) fn with_slow_verbs(mut self, slow: std::time::Duration) -> Self {
        self.slow = slow;
        self
    }

    fn block(&self) {
        if !self.slow.is_zero() {
            std::thread::sleep(self.slow);
        }
    }

    /// The same device with a GID of this kind (set before a fabric opens it).
    pub(crate) fn with_gid_kind(mut self, kind: GidKind) -> Self {
        self.gid_kind = kind;
        self
    }

    /// The same device with these limits (set before a fabric opens it).
    pub(crate) fn with_limits(mut self, limits: DeviceLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Another device on the same wire (another host's NIC): its own completion queue, and
    /// a port of the same active MTU.
    pub(crate) fn another_device(&self) -> Self {
        FakeVerbs {
            wire: self.wire.clone(),
            id: NEXT_DEVICE.fetch_add(1, Ordering::Relaxed),
            port_mtu: self.port_mtu,
            gid_kind: self.gid_kind,
            limits: self.limits,
            slow: self.slow,
            events: Arc::default(),
            addresses: Arc::default(),
            removed: Arc::default(),
            event_waits: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, NicState> {
        self.wire.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails the write applied after `n` more successful ones.
    pub(crate) fn fail_write_after(&self, n: u64) {
        self.lock().fail_after = Some(n);
    }

    /// Flips byte `byte` of the write applied after `n` more, in the target's memory, once
    /// it landed (its completions say success).
    pub(crate) fn corrupt_write_after(&self, n: u64, byte: usize) {
        self.lock().corrupt_after = Some((n, byte));
    }

    /// Memory regions registered on this device so far.
    pub(crate) fn registrations(&self) -> u64 {
        self.lock().regions.len() as u64
    }

    pub(crate) fn writes_applied(&self) -> u64 {
        self.lock().writes_applied
    }

    /// Holds this device's completions back from its poller (true) or lets them go (false).
    pub(crate) fn hold_completions(&self, hold: bool) {
        let mut s = self.lock();
        if hold {
            s.held.insert(self.id);
        } else {
            s.held.remove(&self.id);
        }
    }

    /// Queue pairs not yet destroyed.
    pub(crate) fn live_qps(&self) -> usize {
        self.lock().qps.len()
    }

    /// What peers may do through each live queue pair, in queue pair order.
    pub(crate) fn qp_access(&self) -> Vec<RemoteAccess> {
        let s = self.lock();
        let mut qps: Vec<_> = s.qps.iter().map(|(n, q)| (*n, q.remote)).collect();
        qps.sort_by_key(|(n, _)| *n);
        qps.into_iter().map(|(_, a)| a).collect()
    }

    /// What peers may do to the memory registered under `rkey`.
    pub(crate) fn registration_access(&self, rkey: u32) -> Option<RemoteAccess> {
        self.lock().regions.get(&rkey).map(|(_, access)| *access)
    }
}

impl Verbs for FakeVerbs {
    type Qp = FakeQp;

    fn device_id(&self) -> u64 {
        self.id
    }

    fn port(&self) -> PortInfo {
        let (lid, gid) = self
            .addresses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .read;
        PortInfo {
            lid,
            gid,
            mtu: self.port_mtu,
            gid_kind: self.gid_kind,
        }
    }

    fn refresh_port(&self) -> Result<PortInfo, VerbsError> {
        {
            let mut a = self.addresses.lock().unwrap_or_else(|p| p.into_inner());
            a.read = a.hardware;
        }
        Ok(self.port())
    }

    fn limits(&self) -> DeviceLimits {
        self.limits
    }

    fn register(&self, memory: &Arc<RdmaMemory>, access: RemoteAccess) -> Result<(), VerbsError> {
        self.block();
        if memory.region().1 as u64 > self.limits.max_mr_size {
            return Err(VerbsError::new(
                "ibv_reg_mr",
                "Invalid argument (os error 22)",
            ));
        }
        let mut s = self.lock();
        s.next_key += 1;
        let key = s.next_key;
        s.regions.insert(key, (Arc::downgrade(memory), access));
        let keys = MrKeys {
            lkey: key,
            rkey: key,
            addr: memory.region().0,
            device_id: self.id,
        };
        // Deregistering unpins the region: as slow as registering.
        memory.set_registration(keys, Box::new(SlowDrop(self.slow)))
    }

    fn create_qp(&self, send_depth: u32, recv_depth: u32) -> Result<FakeQp, VerbsError> {
        self.block();
        if send_depth.max(recv_depth) > self.limits.max_qp_wr {
            return Err(VerbsError::new(
                "ibv_create_qp",
                "Invalid argument (os error 22)",
            ));
        }
        let mut s = self.lock();
        s.next_qpn += 1;
        let qpn = s.next_qpn;
        s.qps.insert(
            qpn,
            QpModel {
                device: self.id,
                state: QpState::Reset,
                peer: None,
                path_mtu: None,
                remote: RemoteAccess::None,
                gid_kind: self.gid_kind,
                recvs: VecDeque::new(),
                backlog: VecDeque::new(),
            },
        );
        Ok(FakeQp {
            verbs: self.clone(),
            qpn,
        })
    }

    fn next_event(&self, wait: std::time::Duration) -> EventWait {
        self.event_waits.fetch_add(1, Ordering::Relaxed);
        let until = std::time::Instant::now() + wait;
        loop {
            if self.removed.load(Ordering::Relaxed) {
                return EventWait::Gone("the device's event channel failed (removed)".into());
            }
            let next = self
                .events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            if let Some(event) = next {
                return EventWait::Event(event);
            }
            if std::time::Instant::now() >= until {
                return EventWait::Quiet;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<(), VerbsError> {
        let mut s = self.lock();
        if s.held.contains(&self.id) {
            return Ok(());
        }
        if let Some(cq) = s.cqs.get_mut(&self.id) {
            let n = cq.len().min(max);
            out.extend(cq.drain(..n).map(|(_, wc)| wc));
        }
        Ok(())
    }
}

/// Sleeps when dropped, as `ibv_dereg_mr` takes a while on a large region.
struct SlowDrop(std::time::Duration);

impl Drop for SlowDrop {
    fn drop(&mut self) {
        if !self.0.is_zero() {
            std::thread::sleep(self.0);
        }
    }
}

#[derive(Debug)]
pub(crate) struct FakeQp {
    verbs: FakeVerbs,
    qpn: u32,
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        self.verbs.block();
        // Destroyed: nothing of it applied any more, and its completions not yet polled are
        // purged from its device's queue.
        let mut s = self.verbs.lock();
        s.qps.remove(&self.qpn);
        if let Some(cq) = s.cqs.get_mut(&self.verbs.id) {
            cq.retain(|(qpn, _)| *qpn != self.qpn);
        }
    }
}

/// Whether a write of `len` bytes between queue pairs of path MTUs `requester` and
/// `responder` is rejected: it spans more than one packet and the two disagree (the
/// responder checks each packet against its own path MTU).
fn mtu_mismatch(requester: Option<u8>, responder: Option<u8>, len: usize) -> bool {
    let bytes = |code: Option<u8>| code.map_or(usize::MAX, |c| 128usize << c);
    requester != responder && len > bytes(requester).min(bytes(responder))
}

impl NicState {
    fn qp(&mut self, qpn: u32) -> Result<&mut QpModel, VerbsError> {
        self.qps
            .get_mut(&qpn)
            .ok_or_else(|| VerbsError::new("fake", format!("no queue pair {qpn}")))
    }

    /// Queues `wc` on the completion queue of `qpn`'s device.
    fn complete(&mut self, qpn: u32, wc: Wc) {
        if let Some(device) = self.qps.get(&qpn).map(|q| q.device) {
            self.cqs.entry(device).or_default().push_back((qpn, wc));
        }
    }

    fn move_to_error(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        qp.state = QpState::Error;
        let flushed: Vec<u64> = qp
            .backlog
            .drain(..)
            .map(|w| w.wr_id)
            .chain(qp.recvs.drain(..))
            .collect();
        for wr_id in flushed {
            self.complete(
                qpn,
                Wc {
                    wr_id,
                    status: WcStatus::Flushed,
                    kind: WcKind::Other,
                },
            );
        }
    }

    /// Applies `qpn`'s backlog in order, as far as it can.
    fn progress(&mut self, qpn: u32) {
        loop {
            let Some(qp) = self.qps.get(&qpn) else { return };
            let Some(w) = qp.backlog.front() else { return };
            let peer = qp.peer.and_then(|p| self.qps.get(&p).map(|m| (p, m)));
            let status = match peer {
                _ if w.local_failure.is_some() => w.local_failure.unwrap_or(LOCAL_LENGTH),
                Some((_, m))
                    if matches!(m.state, QpState::Rtr | QpState::Rts) && m.peer == Some(qpn) =>
                {
                    if w.imm.is_some() && m.recvs.is_empty() {
                        return; // RNR: wait for a receive
                    }
                    if qp.gid_kind != m.gid_kind {
                        RETRY_EXCEEDED // nothing the responder understands comes back
                    } else if mtu_mismatch(qp.path_mtu, m.path_mtu, w.data.len()) {
                        REMOTE_INVALID_REQUEST
                    } else if m.remote != RemoteAccess::Write {
                        REMOTE_ACCESS
                    } else if self.fail_after == Some(0) {
                        self.fail_after = None;
                        RETRY_EXCEEDED
                    } else {
                        WcStatus::Success
                    }
                }
                // No responder connected back to us (gone, in ERROR, never there).
                _ => RETRY_EXCEEDED,
            };
            let Some(w) = self.qps.get_mut(&qpn).and_then(|q| q.backlog.pop_front()) else {
                return;
            };
            let status = if status == WcStatus::Success {
                let flip = match self.corrupt_after {
                    Some((0, byte)) => {
                        self.corrupt_after = None;
                        Some(byte)
                    }
                    Some((n, byte)) => {
                        self.corrupt_after = Some((n - 1, byte));
                        None
                    }
                    None => None,
                };
                self.apply(&w, flip)
            } else {
                status
            };
            if status == WcStatus::Success {
                if let Some(imm) = w.imm {
                    let peer = self.qps.get(&qpn).and_then(|q| q.peer);
                    if let Some((p, recv)) = peer.and_then(|p| {
                        let recv = self.qps.get_mut(&p)?.recvs.pop_front()?;
                        Some((p, recv))
                    }) {
                        self.complete(
                            p,
                            Wc {
                                wr_id: recv,
                                status: WcStatus::Success,
                                kind: WcKind::RecvImm {
                                    imm,
                                    byte_len: w.data.len() as u32,
                                },
                            },
                        );
                    }
                }
                self.writes_applied += 1;
                if let Some(n) = self.fail_after.as_mut() {
                    *n -= 1;
                }
                self.complete(
                    qpn,
                    Wc {
                        wr_id: w.wr_id,
                        status,
                        kind: WcKind::Write,
                    },
                );
            } else {
                self.complete(
                    qpn,
                    Wc {
                        wr_id: w.wr_id,
                        status,
                        kind: WcKind::Other,
                    },
                );
                self.move_to_error(qpn);
                return;
            }
        }
    }

    /// Copies a write into its region, then flips its byte `flip` if given; a bad key or
    /// range is a remote access error.
    fn apply(&self, w: &PendingWrite, flip: Option<usize>) -> WcStatus {
        let Some(region) = self
            .regions
            .get(&w.rkey)
            .filter(|(_, access)| *access == RemoteAccess::Write)
            .and_then(|(memory, _)| memory.upgrade())
        else {
            return REMOTE_ACCESS;
        };
        let g = region.geometry();
        let Some(offset) = w.remote_addr.checked_sub(region.region().0) else {
            return REMOTE_ACCESS;
        };
        let slot = offset / g.slot_bytes;
        let within = offset % g.slot_bytes;
        // kvx writes whole slots from their start; the model needs no more.
        if slot >= u64::from(g.slots) || within != 0 || w.data.len() as u64 > g.slot_bytes {
            return REMOTE_ACCESS;
        }
        region.write_slot(slot as u32, &w.data);
        if let Some(k) = flip.filter(|&k| k < w.data.len()) {
            region.with_slot(slot as u32, |s| s[k] ^= 0xFF);
        }
        WcStatus::Success
    }
}

impl VerbsQp for FakeQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn modify(&mut self, to: Transition) -> Result<(), VerbsError> {
        // Every `ibv_modify_qp` is a firmware command.
        self.verbs.block();
        let mut s = self.verbs.lock();
        let qp = s.qp(self.qpn)?;
        let next = qp
            .state
            .after(&to)
            .ok_or_else(|| VerbsError::new("fake modify", format!("{to:?} from {:?}", qp.state)))?;
        match to {
            Transition::Error => s.move_to_error(self.qpn),
            Transition::Init(remote) => {
                qp.remote = remote;
                qp.state = next;
            }
            Transition::Rtr(p) => {
                qp.peer = Some(p.remote.qpn);
                qp.path_mtu = Some(p.mtu);
                qp.state = next;
            }
            _ => qp.state = next,
        }
        Ok(())
    }

    fn post_write(&mut self, wr: &WriteWr<'_>) -> Result<(), VerbsError> {
        let mut data = vec![0u8; wr.len as usize];
        wr.staging.read_slot(wr.local_slot, &mut data);
        let mut s = self.verbs.lock();
        let qp = s.qp(self.qpn)?;
        qp.backlog.push_back(PendingWrite {
            wr_id: wr.wr_id,
            data,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            imm: wr.imm,
            local_failure: (u64::from(wr.len) > self.verbs.limits.max_msg_sz)
                .then_some(LOCAL_LENGTH),
        });
        if qp.state == QpState::Error {
            s.move_to_error(self.qpn);
        } else {
            s.progress(self.qpn);
        }
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<(), VerbsError> {
        let mut s = self.verbs.lock();
        s.qp(self.qpn)?.recvs.push_back(wr_id);
        // A writer waiting for a receive (RNR) goes on.
        let waiting: Vec<u32> = s
            .qps
            .iter()
            .filter(|(_, m)| m.peer == Some(self.qpn) && !m.backlog.is_empty())
            .map(|(q, _)| *q)
            .collect();
        for q in waiting {
            s.progress(q);
        }
        Ok(())
    }
}
