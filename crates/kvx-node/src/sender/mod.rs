//! The sender driver. The `SenderFlow` state machine sits behind a mutex shared by the
//! driver task and the handles: prefill threads call `allocate_blocking`, `stage`, `submit`
//! and `cancel` directly (no round trip through the task), and the task carries out what the
//! core asks for — messages to receivers and the proxy, writes to post — and feeds it
//! replies, completions and timers.
//!
//! Wake-ups: every handle call that changes the core pokes the task (`tokio::sync::Notify`,
//! which keeps a permit, so none is lost); every core event bumps a `watch` version (async
//! waiters) and a `Condvar` (blocking prefill threads), so a cancel wakes a thread blocked in
//! `allocate_blocking` with an error.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use bytes::Bytes;
use kvx_io::{
    ClientEvent, Completion, ControlClient, Env, Fabric, FabricConn, FabricCredential, NotifySink,
    PostWrite, SlotMemory, Transport,
};
use kvx_proto::sender::{
    ChunkSpec, Destination, RequestSpec, SendError, SendFailure, SenderEvent, SenderFlow, Transmit,
};
use kvx_proto::wire;
use kvx_proto::{PeerId, ReqId, SenderConfig, StagingSlot};
use tokio::sync::{mpsc, watch, Notify};

use crate::StartError;
use staging_turn::StagingTurn;

mod fabric_link;
mod staging_turn;

/// Where a receiver (one TP rank of a decode worker) listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReceiverAddr {
    /// Its alloc channel (LMCache: `tcp://host:alloc_port[rank]`).
    pub alloc: String,
    /// Its fabric endpoint.
    pub fabric: String,
}

/// What the driver task and the handles share under one lock: the core (which also
/// remembers each request's outcome and the staging order) and the receivers connected.
#[derive(Debug)]
struct Core {
    flow: SenderFlow,
    receivers: BTreeMap<ReceiverAddr, PeerId>,
    next_peer: u64,
    shutdown: bool,
}

#[derive(Debug)]
struct Shared {
    core: Mutex<Core>,
    /// Pokes the driver task after a handle call changed the core.
    poke: Notify,
    /// Bumped on every core event, for async waiters.
    version: watch::Sender<u64>,
    /// Signalled on every core event, for threads blocked in `allocate_blocking`.
    cv: Condvar,
    /// Bytes staged in each staging slot (a partial last chunk writes fewer).
    lens: Vec<AtomicUsize>,
    /// The checksum of what each staging slot holds, with `CHECKSUM_SET` or-ed in once one
    /// is computed (`SenderConfig::checksums`).
    checksums: Vec<AtomicU64>,
    compute_checksums: bool,
}

/// Marks a `Shared::checksums` entry as computed.
const CHECKSUM_SET: u64 = 1 << 32;

impl Shared {
    /// Records what `slot` now holds: its length and, when enabled, its checksum (computed
    /// here, while the bytes just written are still in the CPU's caches).
    fn staged(&self, slot: u32, len: usize, memory: &dyn SlotMemory) {
        self.lens[slot as usize].store(len, Ordering::Release);
        let checksum = if self.compute_checksums {
            let mut sum = 0;
            memory.inspect_slot(slot, len, &mut |bytes| sum = kvx_io::chunk_checksum(bytes));
            CHECKSUM_SET | u64::from(sum)
        } else {
            0
        };
        self.checksums[slot as usize].store(checksum, Ordering::Release);
    }

    /// The checksum of what `slot` holds, if one was computed.
    fn checksum(&self, slot: u32) -> Option<u32> {
        let v = self.checksums[slot as usize].load(Ordering::Acquire);
        (v & CHECKSUM_SET != 0).then_some(v as u32)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// Handle to a running sender; clone it freely, use it from any thread.
#[derive(Debug)]
pub struct SenderHandle<E: Env> {
    env: E,
    shared: Arc<Shared>,
    memory: Arc<<E::Fabric as Fabric>::Memory>,
    cmds: mpsc::UnboundedSender<Cmd>,
}

impl<E: Env> Clone for SenderHandle<E> {
    fn clone(&self) -> Self {
        Self {
            env: self.env.clone(),
            shared: self.shared.clone(),
            memory: self.memory.clone(),
            cmds: self.cmds.clone(),
        }
    }
}

#[derive(Debug)]
enum Cmd {
    AddReceiver(
        ReceiverAddr,
        tokio::sync::oneshot::Sender<Result<PeerId, StartError>>,
    ),
    Connected(
        ReceiverAddr,
        PeerId,
        Result<ControlClient, StartError>,
        tokio::sync::oneshot::Sender<Result<PeerId, StartError>>,
    ),
    /// A fabric connection attached with this credential.
    FabricBack(PeerId, FabricConn, FabricCredential),
    /// Connecting the fabric failed for good: writes waiting for it fail with the reason.
    FabricGaveUp(PeerId, kvx_io::FabricError),
}

/// Starts senders.
#[derive(Debug)]
pub struct SenderNode;

impl SenderNode {
    /// Starts a sender whose identity is `local_id`, with `proxy` as its notice endpoint
    /// (None: notices are dropped, for tests without a proxy).
    pub async fn start<E: Env>(
        env: E,
        cfg: SenderConfig,
        chunk_bytes: usize,
        local_id: String,
        proxy: Option<String>,
    ) -> Result<SenderHandle<E>, StartError> {
        let flow = SenderFlow::new(cfg.clone())?;
        let memory = env
            .fabric()
            .allocate_staging(cfg.staging_slots, chunk_bytes)?;
        let sink = match &proxy {
            Some(endpoint) => Some(env.transport().notify_sink(endpoint).await?),
            None => None,
        };
        let (version, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                flow,
                receivers: BTreeMap::new(),
                next_peer: 0,
                shutdown: false,
            }),
            poke: Notify::new(),
            version,
            cv: Condvar::new(),
            lens: (0..cfg.staging_slots)
                .map(|_| AtomicUsize::new(chunk_bytes))
                .collect(),
            checksums: (0..cfg.staging_slots).map(|_| AtomicU64::new(0)).collect(),
            compute_checksums: cfg.checksums,
        });
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (in_tx, in_rx) = mpsc::unbounded_channel();
        let handle = SenderHandle {
            env: env.clone(),
            shared: shared.clone(),
            memory: memory.clone(),
            cmds: cmd_tx.clone(),
        };
        let driver = Driver {
            env: env.clone(),
            shared,
            memory,
            local_id,
            sink,
            clients: BTreeMap::new(),
            control_down: Default::default(),
            acks_due: Vec::new(),
            conns: BTreeMap::new(),
            parked: BTreeMap::new(),
            conn_generation: 0,
            reconnecting: std::collections::BTreeSet::new(),
            connecting: std::collections::BTreeSet::new(),
            credentials: BTreeMap::new(),
            undecodable_logged: kvx_io::LogLimiter::default(),
            inbox_tx: in_tx,
            inbox: in_rx,
            cmds: cmd_rx,
            cmd_tx,
        };
        env.spawn(driver.run());
        Ok(handle)
    }
}

impl<E: Env> SenderHandle<E> {
    fn now(&self) -> kvx_proto::Instant {
        self.env.now()
    }

    /// Connects to a receiver (once; later calls return the same id).
    pub async fn add_receiver(&self, addr: ReceiverAddr) -> Result<PeerId, StartError> {
        if let Some(&peer) = self.shared.lock().receivers.get(&addr) {
            return Ok(peer);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.cmds
            .send(Cmd::AddReceiver(addr, tx))
            .map_err(|_| closed())?;
        rx.await.map_err(|_| closed())?
    }

    /// Begins a request: its admission probe goes out; await `admitted` before staging.
    pub fn begin(&self, spec: RequestSpec) -> Result<(), SendError> {
        let now = self.now();
        self.shared.lock().flow.handle_begin(now, spec)?;
        self.shared.poke.notify_one();
        Ok(())
    }

    /// Waits until the receiver admitted `req_id` (or it ended: delivered counts as
    /// admitted).
    pub async fn admitted(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.wait_for(req_id, |flow| flow.is_admitted(req_id)).await
    }

    /// Waits until `req_id` was delivered (its ProxyNotif sent) or failed. The outcome stays
    /// readable for `SenderConfig::outcomes_kept` ended requests.
    pub async fn outcome(&self, req_id: &ReqId) -> Result<(), SendFailure> {
        self.wait_for(req_id, |_| false).await
    }

    /// Waits until `done` holds or the request has an outcome (the outcome wins when it is
    /// a failure).
    async fn wait_for(
        &self,
        req_id: &ReqId,
        done: impl Fn(&SenderFlow) -> bool,
    ) -> Result<(), SendFailure> {
        let mut version = self.shared.version.subscribe();
        loop {
            {
                let core = self.shared.lock();
                if let Some(outcome) = core.flow.outcome(req_id) {
                    return outcome;
                }
                if done(&core.flow) {
                    return Ok(());
                }
                if !core.flow.knows(req_id) {
                    return Err(SendFailure::Misuse(format!(
                        "request {req_id} is not known"
                    )));
                }
                if core.shutdown {
                    return Err(SendFailure::ChannelLost);
                }
            }
            if version.changed().await.is_err() {
                return Err(SendFailure::ChannelLost);
            }
        }
    }

    /// Takes a staging slot, blocking the calling thread until a write completes, for at most
    /// the configured `staging_timeout`. For prefill worker threads; a cancel of the request
    /// wakes it with an error. Never call it from an async task.
    pub fn allocate_blocking(&self, req_id: &ReqId) -> Result<StagingSlot, SendError> {
        let timeout = self.shared.lock().flow.config().staging_timeout;
        // The Env's clock, as everywhere in the drivers (a simulated one in the simulation).
        let deadline = self.now() + timeout;
        let mut turn = StagingTurn::new(&self.shared);
        let mut core = self.shared.lock();
        loop {
            if let Some(result) = turn.attempt(&mut core, req_id) {
                return result;
            }
            let left = deadline.saturating_since(self.now());
            if left.is_zero() {
                turn.leave(&mut core);
                return Err(SendError::WouldBlock);
            }
            core = self
                .shared
                .cv
                .wait_timeout(core, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The async form of `allocate_blocking`, bounded by `staging_timeout`.
    pub async fn allocate(&self, req_id: &ReqId) -> Result<StagingSlot, SendError> {
        let timeout = self.shared.lock().flow.config().staging_timeout;
        let mut version = self.shared.version.subscribe();
        let mut turn = StagingTurn::new(&self.shared);
        let attempt = async {
            loop {
                if let Some(result) = turn.attempt(&mut self.shared.lock(), req_id) {
                    return result;
                }
                if version.changed().await.is_err() {
                    return Err(SendError::WouldBlock);
                }
            }
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .unwrap_or(Err(SendError::WouldBlock))
        // `turn` leaves the queue here if the call timed out while waiting.
    }

    /// Copies a chunk's bytes into a staging slot the caller holds (and computes its
    /// checksum, when enabled).
    pub fn stage(&self, slot: StagingSlot, bytes: &[u8]) {
        self.memory.write_slot(slot.0, bytes);
        self.shared.staged(slot.0, bytes.len(), &*self.memory);
    }

    /// Lets `fill` write a chunk of `len` bytes straight into a staging slot the caller holds
    /// (no intermediate copy where the memory allows it), then computes its checksum.
    pub fn stage_with(&self, slot: StagingSlot, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        self.memory.fill_slot(slot.0, len, fill);
        self.shared.staged(slot.0, len, &*self.memory);
    }

    /// The staging memory, for callers that fill slots in place themselves. A slot written
    /// after `stage`/`stage_with` without staging it again keeps its old checksum, and the
    /// receiver refuses the chunk as corrupt: stage again after every change.
    pub fn staging(&self) -> &Arc<<E::Fabric as Fabric>::Memory> {
        &self.memory
    }

    /// Submits staged chunks as one batch.
    pub fn submit(
        &self,
        req_id: &ReqId,
        chunks: Vec<ChunkSpec>,
        is_last: bool,
    ) -> Result<(), SendError> {
        let now = self.now();
        let result = self
            .shared
            .lock()
            .flow
            .handle_submit(now, req_id, chunks, is_last);
        self.shared.poke.notify_one();
        result
    }

    /// Aborts a request from any state; waiters get an error.
    pub fn cancel(&self, req_id: &ReqId) -> Result<(), SendError> {
        let now = self.now();
        let result = self.shared.lock().flow.handle_cancel(now, req_id);
        self.shared.poke.notify_one();
        result
    }

    pub fn staging_free(&self) -> u32 {
        self.shared.lock().flow.staging_free()
    }

    /// Stops the driver task; waiters get `ChannelLost`.
    pub fn shutdown(&self) {
        self.shared.lock().shutdown = true;
        self.shared.poke.notify_one();
        self.shared.version.send_modify(|v| *v += 1);
        self.shared.cv.notify_all();
    }
}

fn closed() -> StartError {
    StartError::Transport(kvx_io::TransportError::Closed)
}

#[derive(Debug)]
enum Input {
    Client(PeerId, ClientEvent),
    /// A completion from connection generation `u64` to the peer.
    Done(PeerId, u64, Completion),
    /// That connection's completion stream ended: it is gone.
    ConnGone(PeerId, u64),
}

struct Driver<E: Env> {
    env: E,
    shared: Arc<Shared>,
    memory: Arc<<E::Fabric as Fabric>::Memory>,
    local_id: String,
    sink: Option<NotifySink>,
    clients: BTreeMap<PeerId, mpsc::Sender<Bytes>>,
    /// Receivers whose control channel is down (between the transport's `Disconnected` and
    /// `Reconnected`): what would be sent to them is lost, so requests fail at once instead
    /// of waiting out the reply timeout.
    control_down: std::collections::BTreeSet<PeerId>,
    /// Receivers whose `Disconnected` has been processed (their requests failed) and not yet
    /// acknowledged to the transport (`kvx_io::DISCONNECT_ACK`), which drops everything sent
    /// to them until then.
    acks_due: Vec<PeerId>,
    /// The live fabric connection to each receiver, with its generation (so that errors of
    /// a connection already replaced do not reset its successor) and the credential it
    /// attached with.
    conns: BTreeMap<PeerId, (u64, kvx_io::fabric::ConnPoster, FabricCredential)>,
    conn_generation: u64,
    /// Receivers whose fabric connection is wanted but not up: writes to them wait.
    reconnecting: std::collections::BTreeSet<PeerId>,
    /// Receivers with a connect attempt under way.
    connecting: std::collections::BTreeSet<PeerId>,
    /// The credential each receiver last sent (`AllocResponse::fabric_credential`): a fabric
    /// connection is attached only with one, and again whenever it changes.
    credentials: BTreeMap<PeerId, FabricCredential>,
    /// Undecodable replies are logged at most once a second.
    undecodable_logged: kvx_io::LogLimiter,
    /// Writes waiting for a receiver's new fabric connection, in posting order
    /// (`fabric_link`); at most one per staging slot.
    parked: BTreeMap<PeerId, Vec<PostWrite>>,
    inbox_tx: mpsc::UnboundedSender<Input>,
    inbox: mpsc::UnboundedReceiver<Input>,
    cmds: mpsc::UnboundedReceiver<Cmd>,
    cmd_tx: mpsc::UnboundedSender<Cmd>,
}

impl<E: Env> Driver<E> {
    async fn run(mut self) {
        loop {
            self.carry_out().await;
            let (deadline, shutdown) = {
                let core = self.shared.lock();
                (core.flow.poll_timeout(), core.shutdown)
            };
            if shutdown {
                return;
            }
            let sleep = crate::sleep_until_deadline(&self.env, deadline);
            tokio::select! {
                _ = self.shared.poke.notified() => {}
                Some(input) = self.inbox.recv() => self.on_input(input),
                Some(cmd) = self.cmds.recv() => self.on_cmd(cmd),
                _ = sleep => {
                    let now = self.env.now();
                    self.shared.lock().flow.handle_timeout(now);
                }
            }
        }
    }

    fn on_input(&mut self, input: Input) {
        let now = self.env.now();
        let mut core = self.shared.lock();
        match input {
            Input::Client(peer, ClientEvent::Message(bytes)) => match wire::decode(&bytes) {
                Ok(msg) => {
                    let credential = match &msg {
                        wire::Message::AllocResponse(r) => r.fabric_credential.clone(),
                        _ => None,
                    };
                    core.flow.handle_message(now, peer, msg);
                    if let Some(text) = credential {
                        drop(core);
                        self.on_credential(peer, &text);
                    }
                }
                Err(e) => {
                    metrics::counter!(crate::metrics::DECODE_ERRORS).increment(1);
                    if let Some(left_out) = self.undecodable_logged.allow() {
                        tracing::warn!(%peer, error = %e, left_out, "undecodable reply; the reply timeout will catch what it answered");
                    }
                }
            },
            Input::Client(peer, ClientEvent::Disconnected) => {
                self.control_down.insert(peer);
                core.flow.handle_receiver_lost(now, peer);
                self.acks_due.push(peer);
            }
            // The receiver may have restarted: its fabric endpoint is a new listener, so the
            // old fabric connection is dead too, and its credential may be void. Replace the
            // connection once the receiver's next reply brings a credential.
            Input::Client(peer, ClientEvent::Reconnected) => {
                self.control_down.remove(&peer);
                drop(core);
                self.credentials.remove(&peer);
                self.reset_fabric(peer);
            }
            Input::Done(peer, generation, c) => {
                let broken = matches!(
                    c.result,
                    Err(kvx_io::FabricError::Flushed
                        | kvx_io::FabricError::Closed
                        | kvx_io::FabricError::Io(_))
                );
                core.flow
                    .handle_write_done(now, c.id, c.result.map_err(|e| e.to_string()));
                // A completed write frees a staging slot without any core event: wake the
                // allocators waiting for one, async and blocking alike.
                drop(core);
                self.wake_waiters();
                // A connection whose writes fail (a QP in error, a dropped socket) is never
                // used again: replace it (found by the simulation: it once never was).
                if broken {
                    self.replace_if_current(peer, generation);
                }
            }
            Input::ConnGone(peer, generation) => {
                drop(core);
                self.replace_if_current(peer, generation);
            }
        }
    }

    fn wake_waiters(&self) {
        self.shared.version.send_modify(|v| *v += 1);
        self.shared.cv.notify_all();
    }

    fn on_cmd(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::AddReceiver(addr, reply) => {
                let mut core = self.shared.lock();
                if let Some(&peer) = core.receivers.get(&addr) {
                    let _ = reply.send(Ok(peer));
                    return;
                }
                // Ids are never reused, even after a failed connect (found by the
                // simulation: two receivers once shared an id, and so a channel).
                core.next_peer += 1;
                let peer = PeerId(core.next_peer);
                core.receivers.insert(addr.clone(), peer);
                drop(core);
                let (env, cmd_tx) = (self.env.clone(), self.cmd_tx.clone());
                let identity = routing_identity(&self.local_id, &addr.alloc);
                // Connecting is bounded by the transport's own timeouts; it runs beside the
                // loop so replies and completions keep flowing meanwhile. The fabric attaches
                // later, with the credential the receiver's first reply brings.
                self.env.spawn(async move {
                    let result = env
                        .transport()
                        .connect(&addr.alloc, &identity)
                        .await
                        .map_err(StartError::from);
                    let _ = cmd_tx.send(Cmd::Connected(addr, peer, result, reply));
                });
            }
            Cmd::Connected(addr, peer, result, reply) => match result {
                Ok(client) => {
                    self.attach_client(peer, client);
                    let _ = reply.send(Ok(peer));
                }
                Err(e) => {
                    self.shared.lock().receivers.remove(&addr);
                    let _ = reply.send(Err(e));
                }
            },
            Cmd::FabricBack(peer, conn, credential) => self.attach_conn(peer, conn, credential),
            Cmd::FabricGaveUp(peer, error) => {
                self.connecting.remove(&peer);
                self.reconnecting.remove(&peer);
                // A refused credential is void: wait for the receiver's next one.
                if matches!(error, kvx_io::FabricError::Unauthorized(..)) {
                    self.credentials.remove(&peer);
                }
                self.flush_parked(peer, &error.to_string());
            }
        }
    }

    fn attach_client(&mut self, peer: PeerId, mut client: ControlClient) {
        self.clients.insert(peer, client.sender());
        let inbox = self.inbox_tx.clone();
        self.env.spawn(async move {
            while let Some(ev) = client.recv().await {
                if inbox.send(Input::Client(peer, ev)).is_err() {
                    break;
                }
            }
        });
    }

    /// Does what the core asked for: sends, posts, and wakes whoever waits on an event.
    async fn carry_out(&mut self) {
        let (transmits, writes, events) = {
            let mut core = self.shared.lock();
            let mut t = Vec::new();
            while let Some(x) = core.flow.poll_transmit() {
                t.push(x);
            }
            let mut w = Vec::new();
            while let Some(x) = core.flow.poll_write() {
                w.push(x);
            }
            let mut e = Vec::new();
            while let Some(x) = core.flow.poll_event() {
                e.push(x);
            }
            (t, w, e)
        };
        // Acknowledge processed disconnects before anything else reaches those receivers.
        for peer in std::mem::take(&mut self.acks_due) {
            if let Some(client) = self.clients.get(&peer) {
                let _ = client.send(kvx_io::DISCONNECT_ACK).await;
            }
        }
        for t in transmits {
            self.transmit(t).await;
        }
        for w in writes {
            self.post(w);
        }
        if !events.is_empty() {
            self.on_events(events);
        }
    }

    async fn transmit(&mut self, t: Transmit) {
        let bytes = Bytes::from(wire::encode(&t.msg));
        match t.to {
            Destination::Receiver(peer) => {
                let Some(client) = self.clients.get(&peer) else {
                    return;
                };
                // The transport drops what it is handed while reconnecting (a request held
                // across the gap could be one already failed); fail it here, at once.
                if self.control_down.contains(&peer) || client.send(bytes).await.is_err() {
                    let now = self.env.now();
                    self.shared.lock().flow.handle_receiver_lost(now, peer);
                }
            }
            Destination::Proxy => match &self.sink {
                Some(sink) => {
                    if let Err(e) = sink.send(bytes).await {
                        tracing::warn!(error = %e, "notice to the proxy not sent");
                    }
                }
                None => tracing::debug!(msg = ?t.msg, "no proxy configured: notice dropped"),
            },
        }
    }

    fn on_events(&mut self, events: Vec<SenderEvent>) {
        let mut stalled = Vec::new();
        for ev in events {
            match ev {
                // Waiters read admission and outcomes from the core, woken below.
                SenderEvent::Admitted { .. } => {}
                SenderEvent::Delivered { .. } => {
                    metrics::counter!(crate::metrics::SENDER_DELIVERED).increment(1);
                }
                SenderEvent::Failed { req_id, failure } => {
                    metrics::counter!(crate::metrics::SENDER_FAILED).increment(1);
                    tracing::info!(%req_id, %failure, "request failed");
                }
                SenderEvent::ChannelReset { receiver } => {
                    tracing::warn!(%receiver, "control channel reset; the transport reconnects");
                }
                SenderEvent::FabricStalled { receiver } => stalled.push(receiver),
            }
        }
        for receiver in stalled {
            self.flush_parked(receiver, "write overdue while the fabric reconnects");
            self.reset_fabric(receiver);
        }
        self.shared.version.send_modify(|v| *v += 1);
        self.shared.cv.notify_all();
    }
}

/// The routing identity of this sender's control connection to `alloc`: LMCache's
/// `"{local_id}-to-{receiver}"`, cut to ZMTP's 255 bytes when a long host name would make it
/// longer (the cut keeps the identity unique: a hash of the whole replaces the tail).
fn routing_identity(local_id: &str, alloc: &str) -> String {
    const IDENTITY_MAX: usize = 255;
    let full = format!("{local_id}-to-{alloc}");
    if full.len() <= IDENTITY_MAX {
        return full;
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    full.hash(&mut h);
    let tail = format!("-{:016x}", h.finish());
    let mut cut = IDENTITY_MAX - tail.len();
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{tail}", &full[..cut])
}

#[cfg(test)]
mod identity_tests {
    use super::routing_identity;

    #[test]
    fn identities_fit_zmtp_and_stay_distinct() {
        assert_eq!(routing_identity("s", "tcp://h:1"), "s-to-tcp://h:1");
        let long_host = "h".repeat(300);
        let a = routing_identity("s", &format!("tcp://{long_host}:1"));
        let b = routing_identity("s", &format!("tcp://{long_host}:2"));
        assert!(a.len() <= 255 && b.len() <= 255);
        assert_ne!(a, b);
    }
}
