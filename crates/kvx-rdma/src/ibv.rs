//! `IbvVerbs`: the `Verbs` seam over sideway, i.e. rdma-core's libibverbs, which sideway loads
//! at run time. Without the library every call fails with `EOPNOTSUPP`, which `open` reports as
//! "no RDMA device found", like a library that lists no device.
//!
//! One device context, one protection domain, one completion queue (extended when the provider
//! supports it) shared by every queue pair; the completion queue's entries are budgeted so
//! that it cannot overrun. Work completions are read by status first: verbs defines a failed
//! completion's opcode and immediate as undefined, so they are read only on success.

use std::error::Error as StdError;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidEntry, GidType};
use sideway::ibverbs::completion::{
    GenericCompletionQueue, PollCompletionQueueError, WorkCompletionOperationType,
    WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use crate::config::RdmaConfig;
use crate::fabric::RdmaError;
use crate::memory::RdmaMemory;
use crate::verbs::{
    wc_status_name, DeviceEvent, DeviceLimits, EventWait, PortInfo, RemoteAccess, Transition,
    Verbs, VerbsError, VerbsQp, Wc, WcKind, WcStatus, WriteWr,
};
use crate::wire::GidKind;

/// How many completions a basic completion queue's poller takes from the queue at once
/// (sideway's default, left as it is).
const BASIC_POLL_BATCH: usize = 32;

/// `ibv_port_state::IBV_PORT_ACTIVE` and `IBV_LINK_LAYER_ETHERNET` (verbs.h ABI values).
const PORT_ACTIVE: u32 = 4;
const LINK_LAYER_ETHERNET: u8 = 2;
/// errno values (Linux) that `ibv_get_device_list` reports for a missing library / kernel.
const EOPNOTSUPP: i32 = 95;
const ENOSYS: i32 = 38;
/// Hop limit of the GRH: routable RoCE v2 needs more than 1.
const HOP_LIMIT: u8 = 64;
/// RNR NAK timer the responder asks for (12 ≈ 0.64 ms).
const MIN_RNR_TIMER: u8 = 12;

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);

/// The whole source chain of an error, on one line.
fn chain(e: &dyn StdError) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What every queue pair of a device uses.
#[derive(Debug, Clone, Copy)]
struct QpSettings {
    port_num: u8,
    gid_index: u8,
    service_level: u8,
    traffic_class: u8,
    ack_timeout: u8,
    retry_count: u8,
    rnr_retry: u8,
}

/// Completion queue entries promised to live queue pairs.
#[derive(Debug)]
struct CqBudget {
    capacity: u32,
    used: Mutex<u32>,
}

pub struct IbvVerbs {
    name: String,
    id: u64,
    /// As new connections advertise it: read at open, and again by `refresh_port`.
    port: std::sync::RwLock<PortInfo>,
    limits: DeviceLimits,
    settings: QpSettings,
    budget: Arc<CqBudget>,
    cq: GenericCompletionQueue,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
}

impl fmt::Debug for IbvVerbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvVerbs")
            .field("name", &self.name)
            .field("port", &self.settings.port_num)
            .field("gid_index", &self.settings.gid_index)
            .field("port_info", &self.port())
            .finish()
    }
}

impl IbvVerbs {
    /// Opens the configured device (or the first), checks its port, picks the GID, and
    /// allocates the protection domain and completion queue.
    pub fn open(cfg: &RdmaConfig) -> Result<Self, RdmaError> {
        let list = DeviceList::new().map_err(|e| {
            let errno = match &e.0 {
                GetDeviceListErrorKind::Ibverbs(io) => io.raw_os_error(),
                _ => None,
            };
            RdmaError::NoDevice(match errno {
                // What sideway's loader answers when libibverbs.so.1 is not there.
                Some(EOPNOTSUPP) => {
                    "libibverbs is not installed (rdma-core: libibverbs1 and ibverbs-providers)"
                        .to_owned()
                }
                Some(ENOSYS) => "the kernel has no RDMA support loaded (ib_uverbs)".to_owned(),
                _ => format!("libibverbs cannot list devices: {}", chain(&e)),
            })
        })?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        if names.is_empty() {
            return Err(RdmaError::NoDevice(
                "libibverbs lists none (no RDMA NIC, or its driver is not loaded; see `ibv_devices`)".into(),
            ));
        }
        let index =
            match &cfg.device {
                None => 0,
                Some(name) => names.iter().position(|n| n == name).ok_or_else(|| {
                    RdmaError::DeviceNotFound {
                        name: name.clone(),
                        found: names.join(", "),
                    }
                })?,
            };
        let name = names[index].clone();
        let fail = |what: &str, e: &dyn StdError| RdmaError::Device {
            device: name.clone(),
            detail: format!("{what}: {}", chain(e)),
        };
        let device = list
            .get(index)
            .ok_or_else(|| RdmaError::NoDevice(format!("{name} vanished")))?;
        let ctx = device.open().map_err(|e| fail("open", &e))?;
        Self::log_fork_status_once();
        let attr = ctx.query_device().map_err(|e| fail("query device", &e))?;
        let port_attr = ctx
            .query_port(cfg.port)
            .map_err(|e| fail(&format!("port {}", cfg.port), &e))?
            .attr;
        if port_attr.state != PORT_ACTIVE {
            return Err(RdmaError::Device {
                device: name,
                detail: format!(
                    "port {} is not active (state {}; see `ibv_devinfo`)",
                    cfg.port, port_attr.state
                ),
            });
        }
        let ethernet = port_attr.link_layer == LINK_LAYER_ETHERNET;
        let entry = pick_gid(&ctx, cfg.port, cfg.gid_index, ethernet).map_err(|detail| {
            RdmaError::Device {
                device: name.clone(),
                detail,
            }
        })?;
        let gid_index = entry.gid_index();
        let gid = entry.gid();
        let gid_kind = gid_kind_of(&entry);
        let netdev = entry.netdev_name().unwrap_or_else(|_| "-".into());
        tracing::info!(device = %name, port = cfg.port, gid_index, kind = %gid_kind, %netdev, "rdma GID chosen");
        let pd = ctx
            .alloc_pd()
            .map_err(|e| fail("allocate a protection domain", &e))?;
        let capacity = cfg.cq_depth.min(attr.max_cqe().max(1) as u32);
        let mut builder = ctx.create_cq_builder();
        builder.setup_cqe(capacity);
        let cq = match builder.build_ex() {
            Ok(cq) => GenericCompletionQueue::from(cq),
            Err(_) => GenericCompletionQueue::from(
                builder
                    .build()
                    .map_err(|e| fail("create the completion queue", &e))?,
            ),
        };
        tracing::info!(
            device = %name, port = cfg.port, gid_index, ethernet, mtu = port_attr.active_mtu,
            max_qp_wr = attr.max_qp_wr(), max_cqe = attr.max_cqe(), cq_entries = capacity,
            max_msg_sz = port_attr.max_msg_sz, max_mr_size = attr.max_mr_size(),
            memlock = ?crate::limits::memlock_limit(),
            "rdma device opened"
        );
        Ok(IbvVerbs {
            id: NEXT_DEVICE.fetch_add(1, Ordering::Relaxed),
            port: std::sync::RwLock::new(PortInfo {
                lid: port_attr.lid,
                gid: gid.raw,
                mtu: port_attr.active_mtu as u8,
                gid_kind,
            }),
            limits: DeviceLimits {
                max_qp_wr: attr.max_qp_wr().max(1) as u32,
                max_cqe: attr.max_cqe().max(1) as u32,
                cq_entries: capacity,
                max_msg_sz: u64::from(port_attr.max_msg_sz),
                max_mr_size: attr.max_mr_size(),
                memlock_bytes: crate::limits::memlock_limit(),
            },
            settings: QpSettings {
                port_num: cfg.port,
                gid_index: u8::try_from(gid_index).map_err(|_| RdmaError::Device {
                    device: name.clone(),
                    detail: format!("GID index {gid_index} does not fit a GRH (max 255)"),
                })?,
                // Both are bit fields of the address vector and the QP context: 4 and 5 bits.
                service_level: cfg.service_level.min(15),
                traffic_class: cfg.traffic_class,
                ack_timeout: cfg.ack_timeout.min(31),
                retry_count: cfg.retry_count.min(7),
                rnr_retry: cfg.rnr_retry.min(7),
            },
            budget: Arc::new(CqBudget {
                capacity,
                used: Mutex::new(0),
            }),
            name,
            cq,
            pd,
            ctx,
        })
    }

    /// Says once per process whether libibverbs is ready for `fork()`: a child forked while
    /// memory is registered (a serving stack starting its worker processes) can corrupt it
    /// unless fork support is on or the kernel makes it unneeded.
    fn log_fork_status_once() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: a query of libibverbs' process-wide state, without arguments; the
            // library is loaded (a device was listed before this is called).
            #[allow(unsafe_code)]
            let status = unsafe { rdma_mummy_sys::ibv_is_fork_initialized() };
            match status {
                rdma_mummy_sys::IBV_FORK_ENABLED => tracing::info!("libibverbs fork support is on"),
                rdma_mummy_sys::IBV_FORK_UNNEEDED => {
                    tracing::info!("libibverbs fork support is not needed: the kernel is fork-safe")
                }
                _ => tracing::warn!(
                    "libibverbs fork support is off: a process forked while kvx's memory is \
                     registered can corrupt it; set RDMAV_FORK_SAFE=1 before the process starts"
                ),
            }
        });
    }

    /// The opened device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }
}

/// What kind of GID `entry` holds, as the side channel says it.
fn gid_kind_of(entry: &GidEntry) -> GidKind {
    match entry.gid_type() {
        GidType::InfiniBand => GidKind::InfiniBand,
        GidType::RoceV1 => GidKind::RoceV1,
        GidType::RoceV2 => GidKind::RoceV2,
    }
}

/// The GID this port's queue pairs use, from the port's GID table (`ibv_query_gid_table`,
/// which says each GID's kind and netdev): the configured index; else on RoCE the first RoCE
/// v2 GID holding an IPv4 address (routable, what most fabrics use), else the first RoCE v2
/// GID, else the port's first GID (each fallback with a warning); on InfiniBand index 0.
fn pick_gid(
    ctx: &DeviceContext,
    port: u8,
    wanted: Option<u32>,
    ethernet: bool,
) -> Result<GidEntry, String> {
    let table = ctx
        .query_gid_table()
        .map_err(|e| format!("reading the GID table: {}", chain(&e)))?;
    let ours: Vec<GidEntry> = table
        .into_iter()
        .filter(|e| e.port_num() == u32::from(port) && !e.gid().is_zero())
        .collect();
    let none = || format!("port {port} has no GID (see `show_gids`)");
    if let Some(i) = wanted {
        return ours
            .into_iter()
            .find(|e| e.gid_index() == i)
            .ok_or_else(|| {
                format!("GID index {i} of port {port} is empty; pick one from `show_gids`")
            });
    }
    if !ethernet {
        let first = ours.first().copied().ok_or_else(none)?;
        return Ok(ours
            .into_iter()
            .find(|e| e.gid_index() == 0)
            .unwrap_or(first));
    }
    let v2 = |e: &&GidEntry| e.gid_type() == GidType::RoceV2;
    let ipv4 = |e: &&GidEntry| {
        let raw = e.gid().raw;
        raw[..10].iter().all(|&b| b == 0) && raw[10..12] == [0xFF, 0xFF]
    };
    if let Some(e) = ours.iter().filter(v2).find(ipv4) {
        return Ok(*e);
    }
    if let Some(e) = ours.iter().find(v2) {
        tracing::warn!(
            port,
            gid_index = e.gid_index(),
            "no RoCE v2 GID with an IPv4 address: using the first RoCE v2 GID"
        );
        return Ok(*e);
    }
    let first = ours.first().copied().ok_or_else(none)?;
    tracing::warn!(
        port,
        gid_index = first.gid_index(),
        "no RoCE v2 GID: using the port's first GID; the peer must use one of the same kind"
    );
    Ok(first)
}

fn mtu(code: u8) -> Result<Mtu, VerbsError> {
    Ok(match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        5 => Mtu::Mtu4096,
        c => return Err(VerbsError::new("ibv_modify_qp", format!("MTU code {c}"))),
    })
}

impl Verbs for IbvVerbs {
    type Qp = IbvQp;

    fn device_id(&self) -> u64 {
        self.id
    }

    fn port(&self) -> PortInfo {
        *self.port.read().unwrap_or_else(|p| p.into_inner())
    }

    fn refresh_port(&self) -> Result<PortInfo, VerbsError> {
        let port = self.settings.port_num;
        let attr = self
            .ctx
            .query_port(port)
            .map_err(|e| VerbsError::new("ibv_query_port", chain(&e)))?
            .attr;
        let ethernet = attr.link_layer == LINK_LAYER_ETHERNET;
        let entry = pick_gid(
            &self.ctx,
            port,
            Some(u32::from(self.settings.gid_index)),
            ethernet,
        )
        .map_err(|e| VerbsError::new("ibv_query_gid_table", e))?;
        let now = PortInfo {
            lid: attr.lid,
            gid: entry.gid().raw,
            mtu: attr.active_mtu as u8,
            gid_kind: gid_kind_of(&entry),
        };
        *self.port.write().unwrap_or_else(|p| p.into_inner()) = now;
        Ok(now)
    }

    fn limits(&self) -> DeviceLimits {
        self.limits
    }

    fn register(&self, memory: &Arc<RdmaMemory>, access: RemoteAccess) -> Result<(), VerbsError> {
        memory.register_ibv(&self.pd, self.id, access)
    }

    fn create_qp(&self, send_depth: u32, recv_depth: u32) -> Result<IbvQp, VerbsError> {
        let entries = send_depth.saturating_add(recv_depth);
        {
            let mut used = self.budget.used.lock().unwrap_or_else(|p| p.into_inner());
            if used.saturating_add(entries) > self.budget.capacity {
                return Err(VerbsError::new(
                    "create_qp",
                    format!(
                        "the completion queue is full ({} of {} entries promised; this queue pair needs {entries})",
                        *used, self.budget.capacity
                    ),
                ));
            }
            *used += entries;
        }
        let reservation = CqReservation {
            budget: self.budget.clone(),
            entries,
        };
        let mut builder = self.pd.create_qp_builder();
        builder
            .setup_max_send_wr(send_depth.max(1))
            .setup_max_recv_wr(recv_depth.max(1))
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(self.cq.clone())
            .setup_recv_cq(self.cq.clone());
        let qp = match builder.build_ex() {
            Ok(qp) => GenericQueuePair::from(qp),
            Err(_) => GenericQueuePair::from(
                builder
                    .build()
                    .map_err(|e| VerbsError::new("ibv_create_qp", chain(&e)))?,
            ),
        };
        Ok(IbvQp {
            qp,
            settings: self.settings,
            _reservation: reservation,
        })
    }

    #[allow(unsafe_code)]
    fn next_event(&self, wait: std::time::Duration) -> EventWait {
        use rdma_mummy_sys::{ibv_ack_async_event, ibv_async_event, ibv_get_async_event};
        // SAFETY: the context stays open while `self.ctx` lives, which `&self` keeps.
        let ctx = unsafe { self.ctx.context() };
        // SAFETY: `ctx` points at a live `ibv_context`; `async_fd` is a plain field of it.
        let fd = unsafe { (*ctx.as_ptr()).async_fd };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid `pollfd`, for the duration of the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready <= 0 {
            return EventWait::Quiet;
        }
        // A removed (disassociated) device's event channel reports an error at once, every
        // time: the device is gone.
        if pfd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            return EventWait::Gone(format!(
                "the device's event channel failed (revents {:#x}): the device was removed or reset",
                pfd.revents
            ));
        }
        if pfd.revents & libc::POLLIN == 0 {
            return EventWait::Quiet;
        }
        let mut event = std::mem::MaybeUninit::<ibv_async_event>::zeroed();
        // SAFETY: `ctx` is live and `event` is writable; the fd is readable, so this does not
        // block.
        if unsafe { ibv_get_async_event(ctx.as_ptr(), event.as_mut_ptr()) } != 0 {
            let error = std::io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => EventWait::Quiet,
                _ => EventWait::Gone(format!(
                    "reading the device's events failed ({error}): the device was removed or reset"
                )),
            };
        }
        let e = event.as_mut_ptr();
        // SAFETY: filled in by `ibv_get_async_event`. The type is read as the C enum's `u32`
        // (a value this binding's Rust enum does not list would be undefined behaviour as
        // that enum), and each element only for the event types that set it.
        let kind = unsafe {
            let code = std::ptr::addr_of!((*e).event_type).cast::<u32>().read();
            let port = || (*e).element.port_num.max(0) as u32;
            let qpn = || (*(*e).element.qp).qp_num;
            match code {
                0 => DeviceEvent::CqError,
                1 => DeviceEvent::QpFatal { qpn: qpn() },
                2 => DeviceEvent::QpRequestError { qpn: qpn() },
                3 => DeviceEvent::QpAccessError { qpn: qpn() },
                8 => DeviceEvent::DeviceFatal,
                9 => DeviceEvent::PortActive { port: port() },
                10 => DeviceEvent::PortError { port: port() },
                11 => DeviceEvent::LidChange { port: port() },
                13 => DeviceEvent::SmChange { port: port() },
                18 => DeviceEvent::GidChange { port: port() },
                other => DeviceEvent::Other(other),
            }
        };
        // SAFETY: the event `ibv_get_async_event` returned, acknowledged once.
        unsafe { ibv_ack_async_event(e) };
        EventWait::Event(kind)
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<(), VerbsError> {
        // An extended queue's poller leaves what it has not handed out in the queue (its
        // drop ends the poll); a basic queue's takes `BASIC_POLL_BATCH` at a time and would
        // drop the rest of a batch with it, so the bound is a whole number of batches.
        let max = max.div_ceil(BASIC_POLL_BATCH).max(1) * BASIC_POLL_BATCH;
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(()),
            Err(e) => return Err(VerbsError::new("ibv_poll_cq", chain(&e))),
        };
        for wc in poller.take(max) {
            let code = wc.status();
            let status = if code == WorkCompletionStatus::Success as u32 {
                WcStatus::Success
            } else if code == WorkCompletionStatus::WorkRequestFlushedError as u32 {
                WcStatus::Flushed
            } else {
                WcStatus::Failed {
                    code,
                    name: wc_status_name(code),
                    vendor: wc.vendor_err(),
                }
            };
            let kind = if status != WcStatus::Success {
                WcKind::Other
            } else if wc.opcode() == WorkCompletionOperationType::ReceiveWithImmediate as u32 {
                // Immediates travel in network byte order (`post_write`).
                WcKind::RecvImm {
                    imm: u32::from_be(wc.imm_data()),
                    byte_len: wc.byte_len(),
                }
            } else if wc.opcode() == WorkCompletionOperationType::Write as u32 {
                WcKind::Write
            } else {
                WcKind::Other
            };
            out.push(Wc {
                wr_id: wc.wr_id(),
                status,
                kind,
            });
        }
        Ok(())
    }
}

/// Gives a queue pair's completion queue entries back when it is destroyed.
#[derive(Debug)]
struct CqReservation {
    budget: Arc<CqBudget>,
    entries: u32,
}

impl Drop for CqReservation {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(self.entries);
    }
}

pub struct IbvQp {
    // Declared first: the queue pair is destroyed before its entries are given back.
    qp: GenericQueuePair,
    settings: QpSettings,
    _reservation: CqReservation,
}

impl fmt::Debug for IbvQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvQp")
            .field("qpn", &self.qp.qp_number())
            .finish()
    }
}

impl IbvQp {
    fn attributes(&self, to: Transition) -> Result<QueuePairAttribute, VerbsError> {
        let s = self.settings;
        let mut attr = QueuePairAttribute::new();
        match to {
            Transition::Init(remote) => {
                let access = match remote {
                    RemoteAccess::None => AccessFlags::LocalWrite,
                    RemoteAccess::Write => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
                };
                attr.setup_state(QueuePairState::Init)
                    .setup_pkey_index(0)
                    .setup_port(s.port_num)
                    .setup_access_flags(access);
            }
            Transition::Rtr(p) => {
                let mut av = AddressHandleAttribute::new();
                av.setup_dest_lid(p.remote.lid)
                    .setup_port(s.port_num)
                    .setup_service_level(s.service_level);
                let gid = Gid { raw: p.remote.gid };
                if !gid.is_zero() {
                    av.setup_grh(&gid, 0, s.gid_index, HOP_LIMIT, s.traffic_class);
                }
                attr.setup_state(QueuePairState::ReadyToReceive)
                    .setup_path_mtu(mtu(p.mtu)?)
                    .setup_dest_qp_num(p.remote.qpn)
                    .setup_rq_psn(p.remote.psn)
                    .setup_max_dest_read_atomic(0)
                    .setup_min_rnr_timer(MIN_RNR_TIMER)
                    .setup_address_vector(&av);
            }
            Transition::Rts { psn } => {
                attr.setup_state(QueuePairState::ReadyToSend)
                    .setup_sq_psn(psn)
                    .setup_timeout(s.ack_timeout)
                    .setup_retry_cnt(s.retry_count)
                    .setup_rnr_retry(s.rnr_retry)
                    .setup_max_read_atomic(0);
            }
            Transition::Error => {
                attr.setup_state(QueuePairState::Error);
            }
        }
        Ok(attr)
    }
}

impl VerbsQp for IbvQp {
    fn qpn(&self) -> u32 {
        self.qp.qp_number()
    }

    fn modify(&mut self, to: Transition) -> Result<(), VerbsError> {
        let attr = self.attributes(to)?;
        self.qp
            .modify(&attr)
            .map_err(|e| VerbsError::new("ibv_modify_qp", format!("{to:?}: {}", chain(&e))))
    }

    fn post_write(&mut self, wr: &WriteWr<'_>) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_send();
        let handle = guard.construct_wr(wr.wr_id, WorkRequestFlags::Signaled);
        let handle = match wr.imm {
            // Network byte order, as verbs peers expect (`poll` undoes it).
            Some(imm) => handle.setup_write_imm(wr.rkey, wr.remote_addr, imm.to_be()),
            None => handle.setup_write(wr.rkey, wr.remote_addr),
        };
        // On error the guard is dropped, which abandons the work request.
        wr.staging.set_write_sge(handle, wr.local_slot, wr.len)?;
        guard
            .post()
            .map_err(|e| VerbsError::new("ibv_post_send", chain(&e)))
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_recv();
        let _ = guard.construct_wr(wr_id);
        guard
            .post()
            .map_err(|e| VerbsError::new("ibv_post_recv", chain(&e)))
    }
}
