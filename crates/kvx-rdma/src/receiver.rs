//! A receiver's side: the accept loop on the side channel's port, and one task per sender
//! connection that sets up its queue pair, pairs each write with immediate that lands with
//! the frame its sender sent ahead of it (`pairing`), checks the landed bytes against the
//! frame's checksum and announces the write (`Landed`), re-posts the receive it consumed, and
//! answers the fence.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvx_io::{
    ChecksumCheck, ConnectionBudget, Evicted, FabricAccess, Held, LandedWrite, LogLimiter,
    SlotMemory,
};
use kvx_proto::PeerId;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::blocking::off_the_runtime;
use crate::config::{offered_mtu, path_mtu};
use crate::device::Device;
use crate::link;
use crate::memory::RdmaMemory;
use crate::pairing::{Pairing, Recv};
use crate::route::{Route, RouteEvent};
use crate::verbs::{
    Qp, RemoteAccess, RtrParams, Transition, Verbs, VerbsError, Wc, WcKind, WcStatus,
};
use crate::wire::{
    Control, Hello, Inbound, InboundFrame, QpAddr, Welcome, WelcomeStatus, WriteFrame,
    HELLO_BASE_LEN, HELLO_LEN, VERSION,
};

/// Receives a connection keeps posted are the sender's staging slots plus `recv_slack`, at
/// most this many: beyond, a write with immediate waits (RNR retry) for a re-posted receive.
const RECV_DEPTH_MAX: u32 = 4096;

/// Accepts sender connections until the listener's `landed` receiver is dropped. Every
/// connection takes a place in the buffer's `ConnectionBudget` (`connections_max` in all,
/// `connections_per_source_max` from one address); past a cap the newcomer is still taken and
/// the quietest connection is closed for it (never greeted, then unauthenticated, then the
/// authenticated one announced longest ago), so idle sockets cannot lock a sender out.
pub(crate) async fn accept_loop<V: Verbs>(
    listener: TcpListener,
    device: Arc<Device<V>>,
    memory: Arc<RdmaMemory>,
    landed: mpsc::Sender<LandedWrite>,
    access: Arc<FabricAccess>,
) {
    let refusals_logged = Arc::new(LogLimiter::default());
    let budget = ConnectionBudget::new(
        device.config.connections_max,
        device.config.connections_per_source_max,
    );
    loop {
        tokio::select! {
            () = landed.closed() => return,
            accepted = listener.accept() => match accepted {
                Ok((side, peer)) => {
                    let (held, Evicted(evicted)) = budget.open(peer.ip());
                    if evicted > 0 {
                        if let Some(left_out) = refusals_logged.allow() {
                            warn!(
                                %peer, evicted, left_out,
                                "rdma side channel: a connection closed for a newcomer (the \
                                 buffer holds connections_max, or connections_per_source_max \
                                 from one address, and it was the quietest)"
                            );
                        }
                    }
                    let held = Arc::new(held);
                    let conn = Connection {
                        side,
                        peer,
                        device: device.clone(),
                        memory: memory.clone(),
                        landed: landed.clone(),
                        access: access.clone(),
                        refusals_logged: refusals_logged.clone(),
                        held: held.clone(),
                    };
                    tokio::spawn(async move {
                        if held.run(conn.serve()).await.is_none() {
                            debug!(%peer, "rdma side channel: closed for a newcomer");
                        }
                    });
                }
                Err(e) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    warn!(error = %e, "rdma side channel: accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

struct Connection<V: Verbs> {
    side: TcpStream,
    peer: SocketAddr,
    device: Arc<Device<V>>,
    memory: Arc<RdmaMemory>,
    landed: mpsc::Sender<LandedWrite>,
    access: Arc<FabricAccess>,
    refusals_logged: Arc<LogLimiter>,
    /// Its place in the buffer's `ConnectionBudget`: authenticated by a valid credential,
    /// heard from with every write it announces.
    held: Arc<Held>,
}

/// Why a connection's task ended.
#[derive(Debug)]
enum End {
    Fenced,
    SideClosed,
    ListenerDropped,
    Failed(String),
}

impl<V: Verbs> Connection<V> {
    async fn serve(mut self) {
        let _ = self.side.set_nodelay(true);
        let timeout = self.device.config.connect_timeout;
        // The whole hello within `hello_timeout`, however it trickles.
        let hello_by = tokio::time::Instant::now() + self.device.config.hello_timeout;
        let left = || hello_by.saturating_duration_since(tokio::time::Instant::now());
        let base = match link::read_frame::<HELLO_BASE_LEN>(&mut self.side, left()).await {
            Ok(b) => b,
            Err(e) => return debug!(peer = %self.peer, error = %e, "rdma side channel: no hello"),
        };
        // Another protocol on this port gets no answer.
        let Ok(base_hello) = Hello::decode_base(&base) else {
            return debug!(peer = %self.peer, "rdma side channel: not a kvx hello");
        };
        if base_hello.version != VERSION {
            return self.refuse(WelcomeStatus::VersionMismatch).await;
        }
        let rest = match link::read_frame::<{ HELLO_LEN - HELLO_BASE_LEN }>(&mut self.side, left())
            .await
        {
            Ok(b) => b,
            Err(e) => return debug!(peer = %self.peer, error = %e, "rdma side channel: no hello"),
        };
        let mut whole = [0u8; HELLO_LEN];
        whole[..HELLO_BASE_LEN].copy_from_slice(&base);
        whole[HELLO_BASE_LEN..].copy_from_slice(&rest);
        let Ok(hello) = Hello::decode(&whole) else {
            return debug!(peer = %self.peer, "rdma side channel: not a kvx hello");
        };
        if let Some(why) = self.device.unusable() {
            if let Some(left_out) = self.refusals_logged.allow() {
                warn!(peer = %self.peer, why, left_out, "rdma sender refused: the device failed");
            }
            return self.refuse(WelcomeStatus::DeviceUnusable).await;
        }
        let Some(control_peer) = self.access.authenticate(&hello.credential) else {
            if let Some(left_out) = self.refusals_logged.allow() {
                warn!(peer = %self.peer, left_out, "rdma sender refused: its credential was not issued here");
            }
            return self.refuse(WelcomeStatus::Unauthorized).await;
        };
        // A valid credential: no newcomer closes this connection from now on; past the caps
        // it is what closes the quietest authenticated one.
        let Evicted(evicted) = self.held.authenticated();
        if evicted > 0 {
            debug!(peer = %self.peer, evicted, "rdma side channel: a connection closed for an attaching sender");
        }
        if hello.staging.slot_bytes != self.memory.geometry().slot_bytes {
            return self.refuse(WelcomeStatus::StagingMismatch).await;
        }
        let ours = self.device.verbs.port().gid_kind;
        if hello.qp.gid_kind.clashes_with(ours) {
            warn!(peer = %self.peer, sender = %hello.qp.gid_kind, receiver = %ours, "rdma sender refused: its GID is of another kind");
            return self.refuse(WelcomeStatus::GidMismatch).await;
        }
        let (route, wcs) = self.device.router.add();
        let (qp, qp_addr, posted) = match off_the_runtime(|| self.connect_qp(&hello, &route)) {
            Ok(up) => {
                route.bind_qp(up.0.qpn());
                up
            }
            Err(e) => {
                warn!(peer = %self.peer, error = %e, "cannot set up a queue pair for a sender");
                return self.refuse(WelcomeStatus::NoResources).await;
            }
        };
        let Some(keys) = self.memory.keys() else {
            return self.refuse(WelcomeStatus::NoResources).await;
        };
        let welcome = Welcome {
            status: WelcomeStatus::Ok,
            buffer: self.memory.geometry(),
            qp: qp_addr,
            addr: keys.addr,
            rkey: keys.rkey,
        };
        if let Err(e) = link::write_frame(&mut self.side, &welcome.encode(), timeout).await {
            return debug!(peer = %self.peer, error = %e, "rdma side channel: welcome not sent");
        }
        debug!(peer = %self.peer, qpn = qp_addr.qpn, remote_qpn = hello.qp.qpn, %control_peer, "rdma sender connected");
        // The most writes a sender can have sent frames for that this task has not taken the
        // completions of: landed ones, each holding one of the `posted` receives until it is
        // taken and the receive posted again (beyond, the NIC makes the sender wait), plus
        // posted ones not landed, each into a slot granted to it (at most the buffer's).
        let in_flight_max = self.memory.slots() as usize + posted as usize;
        self.run(qp, posted, wcs, route, control_peer, in_flight_max)
            .await;
    }

    async fn refuse(mut self, status: WelcomeStatus) {
        let timeout = self.device.config.connect_timeout;
        let mut refusal = Welcome::refusal(status);
        // The buffer's shape, so a sender with another chunk size can say both sizes.
        if status == WelcomeStatus::StagingMismatch {
            refusal.buffer = self.memory.geometry();
        }
        // Our GID's kind, so a sender of another kind can say both.
        refusal.qp.gid_kind = self.device.verbs.port().gid_kind;
        let _ = link::write_frame(&mut self.side, &refusal.encode(), timeout).await;
    }

    /// A queue pair connected to the sender's, with its receives posted before it can be
    /// written to (how many: the third value).
    fn connect_qp(
        &self,
        hello: &Hello,
        route: &Route,
    ) -> Result<(Qp<V::Qp>, QpAddr, u32), VerbsError> {
        let cfg = &self.device.config;
        let port = self.device.verbs.port();
        let offer = offered_mtu(port.mtu, cfg.mtu);
        let mtu = path_mtu(offer, hello.qp.mtu).ok_or_else(|| {
            VerbsError::new(
                "hello",
                format!("MTU code {} from the sender", hello.qp.mtu),
            )
        })?;
        let depth = self
            .device
            .verbs
            .limits()
            .recv_depth(hello.staging.slots.min(RECV_DEPTH_MAX) + cfg.recv_slack);
        let mut qp = Qp::new(self.device.verbs.create_qp(1, depth)?);
        qp.modify(Transition::Init(RemoteAccess::Write))?;
        for i in 0..depth {
            qp.post_recv(route.wr_id(i))?;
        }
        qp.modify(Transition::Rtr(RtrParams {
            remote: hello.qp,
            mtu,
        }))?;
        let psn = link::fresh_psn();
        qp.modify(Transition::Rts { psn })?;
        let addr = QpAddr {
            qpn: qp.qpn(),
            psn,
            lid: port.lid,
            mtu: offer,
            gid: port.gid,
            gid_kind: port.gid_kind,
        };
        Ok((qp, addr, depth))
    }

    async fn run(
        mut self,
        mut qp: Qp<V::Qp>,
        mut posted: u32,
        mut wcs: mpsc::UnboundedReceiver<RouteEvent>,
        route: Route,
        control_peer: PeerId,
        in_flight_max: usize,
    ) {
        let mut inbound = Inbound::new();
        let mut pairing = Pairing::new(in_flight_max);
        // A write's frame was sent before the write was posted, so it is normally here first or
        // just after; one still missing after a side-channel frame's bound is not coming soon.
        let frame_bound = self.device.config.connect_timeout;
        // Set when the device broke the connection so that its completions will not come (a
        // completion queue or device failure; a failed queue pair's still do).
        let mut device_broke = false;
        let end = loop {
            // Frames already read: a write frame pairs, a control frame ends the loop.
            if let Some(end) = self.take_frames(&mut inbound, &mut pairing, control_peer, true) {
                break end;
            }
            let overdue_at = pairing.deadline(frame_bound);
            tokio::select! {
                biased;
                () = self.landed.closed() => break End::ListenerDropped,
                Some(event) = wcs.recv() => {
                    // These writes' frames were sent before the writes were posted: take what
                    // the socket holds now, so that each pairs at once rather than waiting
                    // behind a stream of completions (this branch goes first).
                    let mut failed = self.take_ready_frames(&mut inbound, &mut pairing, control_peer);
                    let mut next = Some(event);
                    while let Some(event) = next.take() {
                        let why = match event {
                            RouteEvent::Wc(wc) => self
                                .on_wc(&mut qp, &mut posted, &wc, control_peer, &mut pairing)
                                .err(),
                            RouteEvent::Broken { why, completions_follow } => {
                                device_broke = !completions_follow;
                                Some(why)
                            }
                        };
                        if let Some(why) = why {
                            failed = Some(End::Failed(why));
                            break;
                        }
                        next = wcs.try_recv().ok();
                    }
                    if let Some(end) = failed {
                        break end;
                    }
                }
                // What is read is taken at the loop's top: in order, so a fence follows the
                // frames of every write posted before it.
                read = self.side.read(inbound.space()) => match read {
                    Ok(0) => break End::SideClosed,
                    Ok(n) => inbound.filled(n),
                    Err(e) => break End::Failed(format!("side channel: {e}")),
                },
                () = sleep_until_some(overdue_at) => {
                    self.give_up_overdue(&mut pairing, control_peer, frame_bound);
                }
            }
        };
        // Whatever ended it, this connection's writes stop landing now: in ERROR the queue
        // pair accepts nothing more (and its posted receives are flushed).
        qp.move_to_error();
        // Drain before destroy: a destroyed queue pair's completions not yet polled are gone
        // (mlx5 purges them), and with them the notices of writes the sender already saw
        // succeed. In ERROR every posted receive completes — consumed by a write that landed,
        // or flushed — so take them all, announcing the landed ones, before answering the
        // fence and destroying the queue pair (which also hands back its share of the
        // completion queue only when nothing of it is left there).
        let left = if device_broke {
            posted
        } else {
            self.drain(&mut wcs, posted, control_peer, &mut pairing)
                .await
        };
        if left > 0 && !device_broke {
            warn!(peer = %self.peer, left, "rdma receives not drained within half the fence timeout");
        }
        // No more frames are read: writes that landed without theirs go without a checksum
        // (a receiver that requires checksums fails their requests now, rather than at their
        // timeouts). After a fence or the side channel's close there are none: every frame
        // was sent, and read, before the write it precedes could land.
        for recv in pairing.take_waiting() {
            self.announce(control_peer, recv, None);
        }
        if let End::Fenced = end {
            let timeout = self.device.config.connect_timeout;
            if let Err(e) =
                link::write_frame(&mut self.side, &Control::Fenced.encode(), timeout).await
            {
                debug!(peer = %self.peer, error = %e, "fence answer not sent");
            }
        }
        match &end {
            End::Failed(why) => warn!(peer = %self.peer, %why, "rdma sender connection ended"),
            other => debug!(peer = %self.peer, end = ?other, "rdma sender connection ended"),
        }
        // The queue pair is destroyed before this task lets go of the buffer.
        drop(qp);
        drop(route);
        drop(self);
    }

    /// Takes the whole frames `inbound` holds: a write frame pairs (and the write is
    /// announced if its completion came first); with `controls`, a control frame ends the
    /// connection (the fence, or anything else), else it stays for later. Returns the end.
    fn take_frames(
        &self,
        inbound: &mut Inbound,
        pairing: &mut Pairing,
        peer: PeerId,
        controls: bool,
    ) -> Option<End> {
        while let Some(frame) = inbound.next_frame(controls) {
            match frame {
                InboundFrame::Write(f) => match pairing.frame(f) {
                    Ok(Some((recv, f))) => self.announce(peer, recv, Some(f)),
                    Ok(None) => {}
                    Err(why) => return Some(End::Failed(why)),
                },
                InboundFrame::Control(Control::Fence) => return Some(End::Fenced),
                InboundFrame::Control(other) => {
                    return Some(End::Failed(format!("unexpected {other:?} from the sender")))
                }
            }
        }
        None
    }

    /// Reads what the side channel holds now, without waiting, and takes its write frames
    /// (`take_frames` without controls). Its end of file or error is left for the loop's
    /// read, which sees it again. A `recv` that does not wait, not tokio's `try_read`: that
    /// one reads only once the runtime's reactor has seen the socket readable, which it may
    /// not have yet while completions keep this task busy.
    fn take_ready_frames(
        &self,
        inbound: &mut Inbound,
        pairing: &mut Pairing,
        peer: PeerId,
    ) -> Option<End> {
        loop {
            if let Some(end) = self.take_frames(inbound, pairing, peer, false) {
                return Some(end);
            }
            match rustix::net::recv(
                &self.side,
                inbound.space(),
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((n, _)) if n > 0 => inbound.filled(n),
                _ => return None,
            }
        }
    }

    /// One routed completion of this connection's receive queue. The NIC wrote before anyone
    /// could check: the access rules decide here whether the write is announced (a write
    /// outside its queue pair's peer's grants is counted and never announced; what such a
    /// write does to another request's bytes is `docs/operations.md` §Access over RDMA).
    /// `posted` counts the receives outstanding: one fewer per completion, one more per
    /// repost.
    fn on_wc(
        &self,
        qp: &mut Qp<V::Qp>,
        posted: &mut u32,
        wc: &Wc,
        peer: PeerId,
        pairing: &mut Pairing,
    ) -> Result<(), String> {
        *posted = posted.saturating_sub(1);
        match (wc.status, wc.kind) {
            (WcStatus::Success, kind) => {
                if let WcKind::RecvImm { imm, byte_len } = kind {
                    self.landed_write(peer, Recv { imm, byte_len }, pairing);
                }
                qp.post_recv(wc.wr_id).map_err(|e| e.to_string())?;
                *posted += 1;
                Ok(())
            }
            // The queue pair went to ERROR (an asynchronous error): nothing lands any more.
            (WcStatus::Flushed, _) => Err("the queue pair's receives were flushed".into()),
            (WcStatus::Failed { name, code, .. }, _) => {
                Err(format!("receive failed: {name} (status {code})"))
            }
        }
    }

    /// Takes the completions of the `posted` receives left after the queue pair went to
    /// ERROR, announcing the writes that landed, for at most half the fence timeout; returns how
    /// many did not come.
    async fn drain(
        &self,
        wcs: &mut mpsc::UnboundedReceiver<RouteEvent>,
        mut posted: u32,
        peer: PeerId,
        pairing: &mut Pairing,
    ) -> u32 {
        // Half the fence timeout: the sender waits `fence_timeout` for `Fenced`, which is
        // sent after the drain, so a slow drain still leaves time for the answer.
        let deadline = tokio::time::Instant::now() + self.device.config.fence_timeout / 2;
        while posted > 0 {
            match tokio::time::timeout_at(deadline, wcs.recv()).await {
                // The device broke the connection: its completions will not come.
                Ok(Some(RouteEvent::Broken {
                    completions_follow: false,
                    ..
                })) => break,
                // Its queue pair failed: the rest of its receives still complete.
                Ok(Some(RouteEvent::Broken { .. })) => {}
                Ok(Some(RouteEvent::Wc(wc))) => {
                    posted -= 1;
                    if let (WcStatus::Success, WcKind::RecvImm { imm, byte_len }) =
                        (wc.status, wc.kind)
                    {
                        self.landed_write(peer, Recv { imm, byte_len }, pairing);
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        posted
    }

    /// A write with immediate landed: announced once its frame is here (`pairing`), else
    /// when the frame comes or the wait for it is given up.
    fn landed_write(&self, peer: PeerId, recv: Recv, pairing: &mut Pairing) {
        let now = tokio::time::Instant::now();
        if let Some((recv, frame)) = pairing.completion(recv, now) {
            self.announce(peer, recv, Some(frame));
        }
        // More waiting than the peer can have in flight gives the oldest up now.
        self.give_up_overdue(pairing, peer, self.device.config.connect_timeout);
    }

    /// Announces the writes whose frames did not come within `bound` without a checksum.
    fn give_up_overdue(&self, pairing: &mut Pairing, peer: PeerId, bound: Duration) {
        let now = tokio::time::Instant::now();
        while let Some(recv) = pairing.overdue(now, bound) {
            if let Some(left_out) = self.refusals_logged.allow() {
                warn!(
                    peer = %self.peer, imm = recv.imm, left_out,
                    "rdma write announced without a checksum: its frame did not come in time"
                );
            }
            self.announce(peer, recv, None);
        }
    }

    /// The access rules decide whether the write is announced; if it is, with how the landed
    /// bytes compare with its frame's checksum (`Absent` without a frame, or a frame without
    /// a checksum).
    fn announce(&self, peer: PeerId, recv: Recv, frame: Option<WriteFrame>) {
        let Recv { imm, byte_len } = recv;
        let tag = kvx_proto::WriteTag::from_imm(imm);
        if let Err(refusal) = self
            .access
            .admit(peer, tag.slot.0, u64::from(byte_len), Some(imm))
        {
            if let Some(left_out) = self.refusals_logged.allow() {
                warn!(%refusal, left_out, "rdma write not announced");
            }
            return;
        }
        self.held.heard();
        let checksum = match frame.and_then(|f| f.checksum.map(|sum| (f.len, sum))) {
            None => ChecksumCheck::Absent,
            Some((len, carried)) => {
                let computed = self.landed_checksum(tag.slot.0, byte_len);
                // A length other than the frame's is not the write its sender described.
                if computed == carried && len == byte_len {
                    ChecksumCheck::Match
                } else {
                    ChecksumCheck::Mismatch { carried, computed }
                }
            }
        };
        let notice = LandedWrite {
            peer,
            slot: tag.slot,
            tag,
            bytes: u64::from(byte_len),
            checksum,
        };
        // A closed listener is noticed by the select loop; a full channel cannot happen within
        // the access rules' bound (`kvx_io::landing_channel`).
        if let Err(mpsc::error::TrySendError::Full(_)) = self.landed.try_send(notice) {
            if let Some(left_out) = self.refusals_logged.allow() {
                warn!(
                    left_out,
                    "landing notice dropped: the notice channel is full"
                );
            }
        }
    }

    /// The checksum of the bytes the NIC put in `slot` (`kvx_io::chunk_checksum`, the one a
    /// sender takes over its staging slot), read where they landed: the checksum is of the
    /// bytes the decoder will read. An admitted write's slot is in the buffer; a length past
    /// the slot is cut to it (its checksum cannot match, and the ledger refuses the length).
    fn landed_checksum(&self, slot: u32, byte_len: u32) -> u32 {
        let len = (byte_len as usize).min(self.memory.slot_bytes());
        let mut sum = 0;
        self.memory
            .inspect_slot(slot, len, &mut |bytes| sum = kvx_io::chunk_checksum(bytes));
        sum
    }
}

/// Sleeps until `at`, or for ever without one (a `select!` branch that is off).
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
