//! A sender's connection: the handshake that connects its queue pair to the receiver's
//! (`wire`), then one task that sends each write's frame (its checksum) on the side channel
//! and then posts the write, turns routed work completions into ordered completions
//! (`engine`), watches the side channel, and on failure fences the receiver and flushes.

use std::sync::Arc;
use std::time::Duration;

use kvx_io::fabric::ConnOp;
use kvx_io::{Completion, FabricConn, FabricError, SlotGeometry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::blocking::off_the_runtime;
use crate::config::{offered_mtu, path_mtu};
use crate::device::Device;
use crate::engine::{Phase, RemoteBuffer, SendEngine};
use crate::link;
use crate::memory::RdmaMemory;
use crate::route::{Route, RouteEvent};
use crate::verbs::{Qp, RemoteAccess, RtrParams, Transition, Verbs, VerbsError};
use crate::wire::{
    checked_geometry, Control, GidKind, Hello, QpAddr, Welcome, WelcomeStatus, WriteFrame,
    CONTROL_LEN, VERSION, WELCOME_LEN,
};

fn verbs_err(e: VerbsError) -> FabricError {
    FabricError::Io(format!("rdma: {e}"))
}

/// Connects `staging` to the buffer exposed at `endpoint` and spawns the connection's task.
pub(crate) async fn connect<V: Verbs>(
    device: Arc<Device<V>>,
    endpoint: &str,
    staging: Arc<RdmaMemory>,
    credential: kvx_io::FabricCredential,
) -> Result<FabricConn, FabricError> {
    let ours = staging.geometry();
    match staging.keys() {
        Some(k) if k.device_id == device.verbs.device_id() => {}
        _ => {
            return Err(FabricError::Io(
                "rdma: the staging memory was not allocated by this RdmaFabric".into(),
            ))
        }
    }
    let timeout = device.config.connect_timeout;
    let mut side = link::connect(endpoint, timeout).await?;
    let mut qp =
        Qp::new(off_the_runtime(|| device.verbs.create_qp(ours.slots, 1)).map_err(verbs_err)?);
    qp.modify(Transition::Init(RemoteAccess::None))
        .map_err(verbs_err)?;
    let (route, wcs) = device.router.add();
    route.bind_qp(qp.qpn());
    let port = device.verbs.port();
    let offer = offered_mtu(port.mtu, device.config.mtu);
    let psn = link::fresh_psn();
    let hello = Hello {
        version: VERSION,
        staging: ours,
        qp: QpAddr {
            qpn: qp.qpn(),
            psn,
            lid: port.lid,
            mtu: offer,
            gid: port.gid,
            gid_kind: port.gid_kind,
        },
        credential,
    };
    let io = |e: std::io::Error| FabricError::Io(format!("rdma side channel to {endpoint}: {e}"));
    link::write_frame(&mut side, &hello.encode(), timeout)
        .await
        .map_err(io)?;
    let welcome = link::read_frame::<WELCOME_LEN>(&mut side, timeout)
        .await
        .map_err(io)?;
    let welcome = Welcome::decode(&welcome)
        .map_err(|_| FabricError::Io(format!("{endpoint} is not a kvx RDMA endpoint")))?;
    let remote = check_welcome(&welcome, endpoint, ours, port.gid_kind)?;
    let mtu = path_mtu(offer, welcome.qp.mtu)
        .ok_or_else(|| FabricError::Io(format!("{endpoint} sent MTU code {}", welcome.qp.mtu)))?;
    qp.modify(Transition::Rtr(RtrParams {
        remote: welcome.qp,
        mtu,
    }))
    .and_then(|()| qp.modify(Transition::Rts { psn }))
    .map_err(verbs_err)?;
    debug!(
        endpoint,
        qpn = qp.qpn(),
        remote_qpn = welcome.qp.qpn,
        "rdma connection up"
    );
    let (ops_tx, ops) = mpsc::unbounded_channel();
    let (done, done_rx) = mpsc::unbounded_channel();
    let task = SenderTask {
        conn: Conn {
            engine: SendEngine::new(qp, staging, remote, route.key()),
            route,
            wcs,
            ops,
            done,
            batch: Vec::new(),
            frames: Vec::new(),
            frame_timeout: timeout,
        },
        side,
        fence_timeout: device.config.fence_timeout,
        device,
    };
    tokio::spawn(task.run());
    Ok(FabricConn::new(ops_tx, done_rx))
}

/// Why two GIDs of different kinds cannot talk, and what to do.
fn gid_mismatch(ours: GidKind, theirs: GidKind) -> String {
    format!(
        "this sender's GID is {ours} and the receiver's {theirs}: packets of one are not \
         understood by the other; pick GIDs of one kind on both sides (--rdma-gid-index, \
         `show_gids`)"
    )
}

fn check_welcome(
    w: &Welcome,
    endpoint: &str,
    ours: SlotGeometry,
    our_gid: GidKind,
) -> Result<RemoteBuffer, FabricError> {
    let refused = |why: &str| FabricError::Io(format!("{endpoint} refused the connection: {why}"));
    let incompatible = |why: String| FabricError::Incompatible {
        endpoint: endpoint.to_owned(),
        why,
    };
    match w.status {
        WelcomeStatus::Ok => {}
        WelcomeStatus::VersionMismatch => {
            return Err(incompatible(format!(
                "the receiver speaks another side-channel version (we speak {})",
                crate::wire::VERSION
            )))
        }
        WelcomeStatus::StagingMismatch => {
            return Err(incompatible(kvx_io::fabric::slot_size_mismatch(
                ours.slot_bytes as usize,
                w.buffer.slot_bytes as usize,
            )))
        }
        WelcomeStatus::Unauthorized => {
            return Err(FabricError::Unauthorized(
                endpoint.to_owned(),
                "not issued by this receiver (it may have restarted)".into(),
            ))
        }
        WelcomeStatus::GidMismatch => {
            return Err(incompatible(gid_mismatch(our_gid, w.qp.gid_kind)))
        }
        WelcomeStatus::NoResources => return Err(refused("it could not set up a queue pair")),
        WelcomeStatus::DeviceUnusable => {
            return Err(refused(
                "its RDMA device failed and takes no new senders (the receiver's log says why; \
                 it must be restarted once the device is back)",
            ))
        }
        WelcomeStatus::Unknown(c) => return Err(refused(&format!("unknown status {c}"))),
    }
    if our_gid.clashes_with(w.qp.gid_kind) {
        return Err(incompatible(gid_mismatch(our_gid, w.qp.gid_kind)));
    }
    let g = w.buffer;
    checked_geometry(g.slots, g.slot_bytes as usize)
        .ok()
        .filter(|c| *c == g)
        .ok_or_else(|| FabricError::Io(format!("{endpoint} sent a bad buffer shape {g:?}")))?;
    Ok(RemoteBuffer {
        geometry: g,
        addr: w.addr,
        rkey: w.rkey,
    })
}

struct SenderTask<V: Verbs> {
    conn: Conn<V::Qp>,
    side: TcpStream,
    fence_timeout: Duration,
    device: Arc<Device<V>>,
}

/// The connection's state apart from its side channel (which the fence borrows meanwhile).
struct Conn<Q: crate::verbs::VerbsQp> {
    engine: SendEngine<Q>,
    route: Route,
    wcs: mpsc::UnboundedReceiver<RouteEvent>,
    ops: mpsc::UnboundedReceiver<ConnOp>,
    done: mpsc::UnboundedSender<Completion>,
    /// The ops taken at once (reused).
    batch: Vec<ConnOp>,
    /// Their write frames, sent in one write (reused).
    frames: Vec<u8>,
    /// Bounds the sending of write frames, as every side-channel frame (`connect_timeout`).
    frame_timeout: Duration,
}

/// What the live phase ended with.
enum Ended {
    /// The `FabricConn` was dropped: nobody waits for completions.
    Dropped,
    /// The connection failed; the side channel is still open (`false`) or closed by the
    /// receiver (`true`).
    Failing { side_closed: bool },
}

impl<Q: crate::verbs::VerbsQp> Conn<Q> {
    fn emit(&mut self) {
        while let Some(c) = self.engine.poll_completion() {
            // A closed channel means the owner dropped the connection; `ops` says so next.
            let _ = self.done.send(c);
        }
    }

    /// Takes one op and everything already queued behind it; with the side channel (while
    /// live), sends the frames of the writes it will post first. False: the owner is gone.
    async fn take_ops(&mut self, first: Option<ConnOp>, side: Option<&mut TcpStream>) -> bool {
        let Some(first) = first else { return false };
        let mut batch = std::mem::take(&mut self.batch);
        // Runs go as their pieces: a write per slot (docs/spec/fabrics.md, "Runs").
        batch.extend(first.unrolled());
        while let Ok(next) = self.ops.try_recv() {
            batch.extend(next.unrolled());
        }
        if let Some(side) = side {
            self.send_frames(&batch, side).await;
        }
        for op in batch.drain(..) {
            match op {
                ConnOp::Write(w) => {
                    self.engine.handle_post(w);
                    self.route.posted();
                }
                ConnOp::Reset => self.engine.handle_reset(),
                ConnOp::Run(_) => unreachable!("invariant: runs are unrolled in take_ops"),
            }
        }
        self.batch = batch;
        true
    }

    /// Sends, in one write, a frame for each write with immediate of `batch` that will be
    /// posted, before any is: so the receiver has a write's frame (its checksum) by the time
    /// the write can land, or soon after, and a fence or a close of the side channel comes
    /// after the frames of every write posted before it. A frame whose write is not posted
    /// after all (a failed post, a reset further on) is dropped by the receiver. A side
    /// channel that takes no frames fails the connection: nothing of the batch is posted.
    async fn send_frames(&mut self, batch: &[ConnOp], side: &mut TcpStream) {
        self.frames.clear();
        for op in batch {
            match op {
                ConnOp::Write(w) => {
                    if let (Some(imm), true) = (w.imm, self.engine.would_post(w)) {
                        let frame = WriteFrame {
                            imm,
                            len: w.len as u32,
                            checksum: w.checksum,
                        };
                        self.frames.extend_from_slice(&frame.encode());
                    }
                }
                // Nothing after a reset is posted.
                ConnOp::Reset => break,
                ConnOp::Run(_) => unreachable!("invariant: runs are unrolled in take_ops"),
            }
        }
        if self.frames.is_empty() {
            return;
        }
        if let Err(e) = link::write_frame(side, &self.frames, self.frame_timeout).await {
            self.engine
                .handle_broken(format!("side channel: sending write frames: {e}"));
        }
    }

    fn take_wcs(&mut self, first: RouteEvent) {
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                RouteEvent::Wc(wc) => self.engine.handle_wc(&wc),
                // The device broke it: fence and flush as for a broken side channel (the
                // flush completions may never come; `await_flushes` is bounded).
                RouteEvent::Broken { why, .. } => self.engine.handle_broken(why),
            }
            next = self.wcs.try_recv().ok();
        }
    }

    /// Serves while the connection is live.
    async fn serve(&mut self, side: &mut TcpStream) -> Ended {
        let mut probe = [0u8; CONTROL_LEN];
        loop {
            self.emit();
            if self.engine.phase() != Phase::Live {
                return Ended::Failing { side_closed: false };
            }
            tokio::select! {
                biased;
                op = self.ops.recv() => {
                    if !self.take_ops(op, Some(side)).await {
                        return Ended::Dropped;
                    }
                }
                Some(wc) = self.wcs.recv() => self.take_wcs(wc),
                read = side.read(&mut probe) => {
                    // The receiver sends nothing unasked: its side channel closing (or
                    // anything else) means the connection is over.
                    let (why, closed) = match read {
                        Ok(0) => ("the receiver closed the side channel".to_owned(), true),
                        Ok(_) => ("the receiver sent an unexpected frame".to_owned(), false),
                        Err(e) => (format!("side channel: {e}"), false),
                    };
                    self.engine.handle_broken(why);
                    self.emit();
                    return Ended::Failing { side_closed: closed };
                }
            }
        }
    }

    /// Asks the receiver to move its queue pair to ERROR while flush completions come in.
    /// False: the owner dropped the connection meanwhile.
    async fn fence(&mut self, side: &mut TcpStream, side_closed: bool, timeout: Duration) -> bool {
        let fence = fence_remote(side, side_closed, timeout);
        tokio::pin!(fence);
        loop {
            self.emit();
            tokio::select! {
                biased;
                confirmed = &mut fence => {
                    if let Err(why) = confirmed {
                        warn!(route = self.route.key(), %why, "the receiver did not confirm the fence; flushing anyway");
                    }
                    self.engine.handle_fenced();
                    return true;
                }
                op = self.ops.recv() => {
                    if !self.take_ops(op, None).await {
                        return false;
                    }
                }
                Some(wc) = self.wcs.recv() => self.take_wcs(wc),
            }
        }
    }

    /// Waits for the flush completion of every write still on the send queue, at most
    /// `timeout`. False: the owner dropped the connection meanwhile.
    async fn await_flushes(&mut self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.engine.posted() > 0 {
            self.emit();
            tokio::select! {
                biased;
                op = self.ops.recv() => {
                    if !self.take_ops(op, None).await {
                        return false;
                    }
                }
                Some(wc) = self.wcs.recv() => self.take_wcs(wc),
                () = tokio::time::sleep_until(deadline) => {
                    warn!(route = self.route.key(), outstanding = self.engine.posted(), "flush completions did not come in time; counting them as flushed");
                    self.engine.handle_flush_deadline();
                }
            }
        }
        self.emit();
        true
    }
}

impl<V: Verbs> SenderTask<V> {
    async fn run(self) {
        let SenderTask {
            mut conn,
            mut side,
            fence_timeout,
            device,
        } = self;
        let key = conn.route.key();
        match conn.serve(&mut side).await {
            Ended::Dropped => debug!(route = key, "rdma connection dropped by its owner"),
            Ended::Failing { side_closed } => {
                warn!(
                    route = key,
                    why = conn.engine.failure().unwrap_or("?"),
                    "rdma connection failed; fencing the receiver, then flushing"
                );
                if conn.fence(&mut side, side_closed, fence_timeout).await
                    && conn.await_flushes(fence_timeout).await
                {
                    // Dead: every later post completes with `Flushed` until the owner lets go.
                    while let Some(op) = conn.ops.recv().await {
                        for op in op.unrolled() {
                            if let ConnOp::Write(w) = op {
                                conn.engine.handle_post(w);
                                conn.route.posted();
                                conn.emit();
                            }
                        }
                    }
                }
            }
        }
        // The queue pair (in the engine) is destroyed (off the runtime's workers, `Qp`'s drop)
        // before the staging it may read and the device it belongs to are let go.
        drop(conn);
        drop(side);
        drop(device);
    }
}

/// The fence (`docs/operations.md` §Failures): ask the receiver to move its queue pair to
/// ERROR and wait for its answer. A side channel the receiver closed counts as confirmed: it
/// errors its queue pair before closing, and a dead process has no queue pairs.
async fn fence_remote(
    side: &mut TcpStream,
    side_closed: bool,
    timeout: Duration,
) -> Result<(), String> {
    if side_closed {
        return Ok(());
    }
    let exchange = async {
        side.write_all(&Control::Fence.encode())
            .await
            .map_err(|e| format!("sending the fence: {e}"))?;
        let mut b = [0u8; CONTROL_LEN];
        match side.read_exact(&mut b).await {
            Ok(_) => match Control::decode(&b) {
                Control::Fenced => Ok(()),
                other => Err(format!("the receiver answered the fence with {other:?}")),
            },
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
            Err(e) => Err(format!("waiting for the fence: {e}")),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}
