//! The receiver driver: owns a `ReceiverLedger`, the alloc channel's server side and the
//! exposed fabric buffer, and serves the decoder through a `ReceiverHandle`.

use std::sync::Arc;

use bytes::Bytes;
use kvx_io::{
    ControlServer, Env, ExternalRegion, Fabric, FabricListener, Inbound, LogLimiter, SlotMemory,
    Transport,
};
use kvx_proto::receiver::{
    ChunkLayout, ConsumeError, LandedWrite, LandingVerdict, Outcome, PlacementError, ReceiverEvent,
    ReceiverLedger,
};
use kvx_proto::wire::{self, AllocResponse, Message};
use kvx_proto::{IntoChecked, ReceiverConfig, ReqId, ReqKey, SlotIndex};
use tokio::sync::{mpsc, oneshot};

use crate::metrics as m;
use crate::start::StartError;

/// A request whose chunks are all in the buffer: read `slots` (chunk order), then `consume`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyRequest {
    /// The request (its sender and id).
    pub key: ReqKey,
    /// Its slots, one per chunk, in chunk order (the slots its lease holds).
    pub slots: Vec<SlotIndex>,
    /// The sender's cache key of each chunk, parallel to `slots`.
    pub keys: Vec<String>,
    /// How its chunks are laid out (its first batch's fmt, shape and dtype).
    pub layout: ChunkLayout,
    /// Each chunk's token count where its batch named it, `None` for a full chunk
    /// (`ReceiverEvent::Ready`).
    pub tokens: Vec<Option<u64>>,
}

/// A reservation back with the application: no write can land in its slots any more
/// (`kvx_proto::ReceiverEvent::Returned`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// The reservation's request id.
    pub req_id: ReqId,
    /// Its slots, as reserved (chunk order).
    pub slots: Vec<SlotIndex>,
    /// Its request consumed, or why not: `Withdrawn`, `Unclaimed`, or its request's failure
    /// (a corrupt chunk, a cancel, a lost sender…).
    pub outcome: Outcome,
}

/// Returned reservations, in the order they came back; closed once the driver stopped.
pub type Returns = mpsc::UnboundedReceiver<Returned>;

/// What the decoder hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiverNotice {
    /// Every chunk of a request landed: lease it (`ChunkReader::lease`), read it, consume
    /// the lease.
    Ready(ReadyRequest),
    /// A request ended (consumed, failed, expired); exactly one per request.
    Ended {
        /// The request.
        key: ReqKey,
        /// Consumed, or why it failed.
        outcome: Outcome,
    },
}

#[derive(Debug)]
pub(crate) enum Cmd {
    Acquire(
        ReqKey,
        oneshot::Sender<Result<Vec<SlotIndex>, ConsumeError>>,
    ),
    Consume(ReqKey, oneshot::Sender<Result<(), ConsumeError>>),
    ExternalReady(ReqKey, oneshot::Sender<Result<(), ConsumeError>>),
    Snapshot(oneshot::Sender<Result<BufferSnapshot, ConsumeError>>),
    /// Caller placement (`placement.rs`).
    Reserve(
        String,
        u32,
        Vec<SlotIndex>,
        kvx_proto::ClaimSecret,
        oneshot::Sender<Result<(), PlacementError>>,
    ),
    Withdraw(String, oneshot::Sender<Result<(), PlacementError>>),
    Shutdown,
}

/// The receive buffer's accounting at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BufferSnapshot {
    /// Slots in the buffer.
    pub capacity: u32,
    /// Slots no grant holds.
    pub free: u32,
    /// Slots granted to live requests (written or not).
    pub held: u32,
    /// Slots reserved by admitted requests but not yet allocated to a chunk.
    pub reserved_unallocated: u32,
    /// Slots of rolled-back requests a late write may still hit.
    pub quarantined: u32,
    /// Requests tracked (waiting, admitted or ready).
    pub tracked_requests: usize,
    /// First batches waiting for admission.
    pub admission_queue_len: usize,
}

/// The decoder's side of a running receiver: its notices, and (`reader`) what reads and
/// releases requests.
#[derive(Debug)]
pub struct ReceiverHandle<M> {
    pub(crate) notices: mpsc::UnboundedReceiver<ReceiverNotice>,
    pub(crate) reader: ChunkReader<M>,
    /// Caller placement's returned reservations, until taken (`take_returns`).
    pub(crate) returns: Option<Returns>,
    alloc_endpoint: String,
    fabric_endpoint: String,
}

/// Reads ready requests in place and releases them. Clonable, so that a decoder can read
/// several requests at once from several tasks or threads while one of them takes the
/// notices. Its leases (`lease`, `ReceiverHandle::into_ready_leases`) are in `lease.rs`.
#[derive(Debug)]
pub struct ChunkReader<M> {
    pub(crate) link: ReaderLink,
    pub(crate) memory: Arc<M>,
}

impl<M> Clone for ChunkReader<M> {
    fn clone(&self) -> Self {
        Self {
            link: self.link.clone(),
            memory: self.memory.clone(),
        }
    }
}

/// The way to the driver, whatever the memory: commands with an answer, and releases queued
/// without one (a dropped lease's). Releases have a queue of their own, which the driver
/// reads first, so that a release is never refused for a full queue and comes before
/// anything its caller asks next; each lease queues at most one and leases are bounded by
/// the buffer's slots, so that queue is bounded too.
#[derive(Debug, Clone)]
pub(crate) struct ReaderLink {
    cmds: mpsc::Sender<Cmd>,
    releases: mpsc::UnboundedSender<ReqKey>,
}

impl ReaderLink {
    /// Sends the driver a command and awaits its answer; `Stopped` when the driver has
    /// ended (before taking the command, or with it unanswered).
    async fn ask<T>(
        &self,
        cmd: impl FnOnce(oneshot::Sender<Result<T, ConsumeError>>) -> Cmd,
    ) -> Result<T, ConsumeError> {
        self.ask_or(cmd, || ConsumeError::Stopped).await
    }

    /// `ask`, with the error a stopped driver is answered with.
    pub(crate) async fn ask_or<T, Er>(
        &self,
        cmd: impl FnOnce(oneshot::Sender<Result<T, Er>>) -> Cmd,
        stopped: impl Fn() -> Er,
    ) -> Result<T, Er> {
        let (tx, rx) = oneshot::channel();
        self.cmds.send(cmd(tx)).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    pub(crate) async fn acquire(&self, key: &ReqKey) -> Result<Vec<SlotIndex>, ConsumeError> {
        self.ask(|tx| Cmd::Acquire(key.clone(), tx)).await
    }

    pub(crate) async fn consume(&self, key: &ReqKey) -> Result<(), ConsumeError> {
        self.ask(|tx| Cmd::Consume(key.clone(), tx)).await
    }

    /// Queues a release; nothing to do once the driver has ended (which freed everything).
    pub(crate) fn release(&self, key: &ReqKey) {
        let _ = self.releases.send(key.clone());
    }
}

/// Starts receivers.
#[derive(Debug)]
pub struct ReceiverNode;

impl ReceiverNode {
    /// Binds the alloc channel at `alloc_endpoint` and exposes a buffer of
    /// `cfg.buffer_slots × chunk_bytes`, which its fabric allocates, at `fabric_endpoint`.
    pub async fn start<E: Env>(
        env: E,
        cfg: impl IntoChecked<ReceiverConfig>,
        chunk_bytes: usize,
        alloc_endpoint: &str,
        fabric_endpoint: &str,
    ) -> Result<ReceiverHandle<<E::Fabric as Fabric>::Memory>, StartError> {
        let cfg = cfg.into_checked()?;
        let geometry = crate::start::configured_geometry(cfg.buffer_slots, chunk_bytes)?;
        let ledger = ReceiverLedger::from_checked(cfg);
        let server = env.transport().serve(alloc_endpoint).await?;
        let listener = env.fabric().expose(fabric_endpoint, geometry).await?;
        Ok(Self::run(env, ledger, server, listener))
    }

    /// `start`, with the receive buffer in memory the caller owns (a framework's KV buffer,
    /// a Python object's memory): one buffer slot per whole slot of the region, which must
    /// be `cfg.buffer_slots`. A fabric that needs memory of its own kind (shared memory)
    /// refuses it (`FabricError::ExternalMemory`).
    pub async fn start_in<E: Env>(
        env: E,
        cfg: impl IntoChecked<ReceiverConfig>,
        buffer: ExternalRegion,
        alloc_endpoint: &str,
        fabric_endpoint: &str,
    ) -> Result<ReceiverHandle<<E::Fabric as Fabric>::Memory>, StartError> {
        let cfg = cfg.into_checked()?;
        crate::start::lent_fits("buffer", &buffer, cfg.buffer_slots)?;
        let ledger = ReceiverLedger::from_checked(cfg);
        let server = env.transport().serve(alloc_endpoint).await?;
        let listener = env.fabric().expose_in(fabric_endpoint, buffer).await?;
        Ok(Self::run(env, ledger, server, listener))
    }

    fn run<E: Env>(
        env: E,
        ledger: ReceiverLedger,
        server: ControlServer,
        listener: FabricListener<<E::Fabric as Fabric>::Memory>,
    ) -> ReceiverHandle<<E::Fabric as Fabric>::Memory> {
        // The driver mirrors every grant change before it sends replies or hands on events.
        let ledger = if listener.revocation_stops_writes {
            ledger.with_revocation_stopping_writes()
        } else {
            ledger
        };
        let ledger = ledger.with_slot_bytes(listener.memory.slot_bytes() as u64);
        let (notice_tx, notice_rx) = mpsc::unbounded_channel();
        let (returns_tx, returns_rx) = mpsc::unbounded_channel();
        let (cmd_tx, cmd_rx) = mpsc::channel(kvx_io::transport::CHANNEL_DEPTH);
        let (release_tx, release_rx) = mpsc::unbounded_channel();
        let handle = ReceiverHandle {
            notices: notice_rx,
            reader: ChunkReader {
                link: ReaderLink {
                    cmds: cmd_tx,
                    releases: release_tx,
                },
                memory: listener.memory.clone(),
            },
            returns: Some(returns_rx),
            alloc_endpoint: server.local_endpoint().to_owned(),
            fabric_endpoint: listener.local_endpoint.clone(),
        };
        crate::metrics::register_receiver(&handle.alloc_endpoint, ledger.free_slots());
        let driver = Driver {
            env: env.clone(),
            ledger,
            server,
            listener,
            notices: notice_tx,
            returns: returns_tx,
            cmds: cmd_rx,
            releases: release_rx,
            label: handle.alloc_endpoint.clone(),
            refusals_logged: LogLimiter::default(),
            undecodable_logged: LogLimiter::default(),
        };
        env.spawn(driver.run());
        handle
    }
}

impl<M: SlotMemory> ReceiverHandle<M> {
    /// The bound alloc endpoint (a port 0 request is resolved).
    pub fn alloc_endpoint(&self) -> &str {
        &self.alloc_endpoint
    }

    /// The bound fabric endpoint (a port 0 request is resolved).
    pub fn fabric_endpoint(&self) -> &str {
        &self.fabric_endpoint
    }

    /// The next notice; None once the driver stopped. Cancel-safe.
    pub async fn next_notice(&mut self) -> Option<ReceiverNotice> {
        self.notices.recv().await
    }

    /// Reads and releases ready requests; clone it to decode from several tasks.
    pub fn reader(&self) -> &ChunkReader<M> {
        &self.reader
    }

    /// The notices and the reader apart, for a decoder that hands them to different
    /// threads (an embedding program polls notices from one, reads from others).
    pub fn into_parts(self) -> (mpsc::UnboundedReceiver<ReceiverNotice>, ChunkReader<M>) {
        (self.notices, self.reader)
    }
}

impl<M: SlotMemory> ChunkReader<M> {
    /// The receive buffer (its slot count and size; a program's own view of it). Read a
    /// request's slots only while it is leased: after, they may hold another's bytes.
    pub fn memory(&self) -> &Arc<M> {
        &self.memory
    }

    /// Stops the receiver: its alloc channel and fabric listener close, and calls on any
    /// reader fail with `ConsumeError::Stopped`. Also happens once every reader is gone.
    pub async fn shutdown(&self) {
        let _ = self.link.cmds.send(Cmd::Shutdown).await;
    }

    /// The buffer's accounting now (for leak checks and monitoring); `Stopped` once the
    /// driver has ended.
    pub async fn snapshot(&self) -> Result<BufferSnapshot, ConsumeError> {
        self.link.ask(Cmd::Snapshot).await
    }

    /// Marks a legacy (LMCache) sender's allocated request ready, because the proxy reported
    /// it written (`LegacySenders::AfterProxy`); its `Ready` notice follows.
    pub async fn legacy_ready(&self, key: &ReqKey) -> Result<(), ConsumeError> {
        self.link
            .ask(|tx| Cmd::ExternalReady(key.clone(), tx))
            .await
    }
}

struct Driver<E: Env> {
    env: E,
    ledger: ReceiverLedger,
    server: ControlServer,
    listener: FabricListener<<E::Fabric as Fabric>::Memory>,
    notices: mpsc::UnboundedSender<ReceiverNotice>,
    returns: mpsc::UnboundedSender<Returned>,
    cmds: mpsc::Receiver<Cmd>,
    releases: mpsc::UnboundedReceiver<ReqKey>,
    /// The `receiver` label on this receiver's metrics (its alloc endpoint), so the TP ranks
    /// of one process are told apart.
    label: String,
    /// Refused and corrupt landings are logged at most once a second: a peer can cause them
    /// at will.
    refusals_logged: LogLimiter,
    undecodable_logged: LogLimiter,
}

impl<E: Env> Driver<E> {
    async fn run(mut self) {
        let replies = self.server.replies();
        loop {
            self.carry_out(&replies).await;
            let deadline = self.ledger.poll_timeout();
            let sleep = crate::deadline::sleep_until_deadline(&self.env, deadline);
            // Landing notices first: a notice already in the channel happened before any
            // message its write's completion caused (a sender's CancelNotif after a write it
            // was told was corrupt), so the ledger sees them in that order and reports the
            // real reason. The access rules bound the notices, so they cannot starve the rest.
            tokio::select! {
                biased;
                Some(landed) = self.listener.landed.recv() => self.on_landed(landed),
                // Then releases: each was queued before whatever its caller asked next.
                Some(key) = self.releases.recv() => {
                    let now = self.env.now();
                    let _ = self.ledger.handle_consume(now, &key);
                }
                inbound = self.server.next() => match inbound {
                    Some(Inbound::Message(peer, bytes)) => {
                        // Shares count per principal: who stands behind this peer, as the
                        // transport knows it (its public key, or its source address).
                        if let Some(principal) = self.server.principal(peer) {
                            self.ledger.bind_principal(peer, principal);
                        }
                        self.on_message(peer, bytes, &replies).await;
                    }
                    // Its open requests fail now, not after the idle timeout.
                    Some(Inbound::Lost(peer)) => {
                        let now = self.env.now();
                        self.ledger.handle_peer_lost(now, peer);
                    }
                    None => return,
                },
                cmd = self.cmds.recv() => match cmd {
                    Some(Cmd::Acquire(key, reply)) => {
                        let _ = reply.send(self.ledger.handle_acquire(&key));
                    }
                    Some(Cmd::Consume(key, reply)) => {
                        let now = self.env.now();
                        let _ = reply.send(self.ledger.handle_consume(now, &key));
                    }
                    Some(Cmd::ExternalReady(key, reply)) => {
                        let now = self.env.now();
                        let _ = reply.send(self.ledger.handle_external_ready(now, &key));
                    }
                    Some(Cmd::Snapshot(reply)) => {
                        let l = &self.ledger;
                        let _ = reply.send(Ok(BufferSnapshot {
                            capacity: l.capacity(),
                            free: l.free_slots(),
                            held: l.held_slots(),
                            reserved_unallocated: l.reserved_unallocated(),
                            quarantined: l.quarantined_slots(),
                            tracked_requests: l.tracked_requests(),
                            admission_queue_len: l.admission_queue_len(),
                        }));
                    }
                    Some(Cmd::Reserve(req_id, held, slots, secret, reply)) => {
                        let now = self.env.now();
                        let reserved =
                            self.ledger.handle_reserve_held(now, &req_id, held, slots, secret);
                        let _ = reply.send(reserved);
                    }
                    Some(Cmd::Withdraw(req_id, reply)) => {
                        let now = self.env.now();
                        let _ = reply.send(self.ledger.handle_withdraw(now, &req_id));
                    }
                    // The decoder is gone, or asked to stop: nobody will read what arrives.
                    Some(Cmd::Shutdown) | None => return,
                },
                _ = sleep => {
                    let now = self.env.now();
                    self.ledger.handle_timeout(now);
                }
            }
        }
    }

    fn on_landed(&mut self, landed: LandedWrite) {
        let now = self.env.now();
        let verdict = self.ledger.handle_chunk_landed(now, landed);
        let (metric, why) = match verdict {
            LandingVerdict::Refused(why) => (m::LANDINGS_REFUSED, why),
            LandingVerdict::Corrupt(why) => (m::CORRUPT_CHUNKS, why),
            _ => return,
        };
        metrics::counter!(metric, "receiver" => self.label.clone()).increment(1);
        if let Some(left_out) = self.refusals_logged.allow() {
            tracing::warn!(receiver = %self.label, %why, left_out, "landed write not accepted");
        }
    }

    async fn on_message(
        &mut self,
        peer: kvx_proto::PeerId,
        bytes: Bytes,
        replies: &mpsc::Sender<(kvx_proto::PeerId, Bytes)>,
    ) {
        match wire::decode(&bytes) {
            Ok(msg) => {
                let now = self.env.now();
                self.ledger.handle_message(now, peer, msg);
            }
            Err(e) => {
                // Garbage gets an error reply, LMCache-shaped, and changes nothing else.
                metrics::counter!(m::DECODE_ERRORS, "receiver" => self.label.clone()).increment(1);
                if let Some(left_out) = self.undecodable_logged.allow() {
                    tracing::warn!(%peer, error = %e, len = bytes.len(), left_out, "undecodable message");
                }
                // Whoever sends garbage is no LMCache peer; the reason is worth more than
                // LMCache's exact bytes here.
                let reason = format!("undecodable message: {e}");
                let reply = AllocResponse {
                    error: Some(reason),
                    ..AllocResponse::refused(1, String::new(), None)
                };
                let bytes = Bytes::from(wire::encode(&Message::AllocResponse(reply)));
                let _ = replies.send((peer, bytes)).await;
            }
        }
    }

    async fn carry_out(&mut self, replies: &mpsc::Sender<(kvx_proto::PeerId, Bytes)>) {
        // The fabric learns of grants before the replies that hand them out leave.
        while let Some(change) = self.ledger.poll_grant_change() {
            self.listener.access.apply(change);
        }
        while let Some((peer, mut reply)) = self.ledger.poll_transmit() {
            // A kvx sender (its messages carry `seq`) attaches its fabric connection with this
            // credential; every reply carries it, so the sender always has the current one.
            if reply.seq.is_some() {
                let credential = self.listener.access.credential_for(peer);
                reply.fabric_credential = Some(credential.to_text());
                // The timeouts a sender's own must stay below (`check_sender`).
                let cfg = self.ledger.config();
                reply.request_idle_timeout_ms = Some(millis(cfg.request_idle_timeout));
                reply.write_quarantine_ms = Some(millis(cfg.write_quarantine));
            }
            let bytes = Bytes::from(wire::encode(&Message::AllocResponse(reply)));
            if replies.send((peer, bytes)).await.is_err() {
                return;
            }
        }
        while let Some(ev) = self.ledger.poll_event() {
            let notice = match ev {
                ReceiverEvent::Admitted { waited, .. } => {
                    metrics::counter!(m::ADMITTED, "receiver" => self.label.clone()).increment(1);
                    metrics::histogram!(m::ADMISSION_WAIT_SECONDS, "receiver" => self.label.clone()).record(waited.as_secs_f64());
                    continue;
                }
                ReceiverEvent::Ready {
                    key,
                    slots,
                    keys,
                    layout,
                    tokens,
                } => ReceiverNotice::Ready(ReadyRequest {
                    key,
                    slots,
                    keys,
                    layout,
                    tokens,
                }),
                ReceiverEvent::Ended { key, outcome } => {
                    match &outcome {
                        Outcome::Consumed => {
                            metrics::counter!(m::CONSUMED, "receiver" => self.label.clone())
                                .increment(1)
                        }
                        Outcome::Failed(_) => {
                            metrics::counter!(m::ROLLED_BACK, "receiver" => self.label.clone())
                                .increment(1)
                        }
                    }
                    ReceiverNotice::Ended { key, outcome }
                }
                // The application's, on a stream of its own (`take_returns`).
                ReceiverEvent::Returned {
                    req_id,
                    slots,
                    outcome,
                } => {
                    let _ = self.returns.send(Returned {
                        req_id,
                        slots,
                        outcome,
                    });
                    continue;
                }
            };
            // A decoder that stopped listening misses notices; the unconsumed TTL reclaims.
            let _ = self.notices.send(notice);
        }
        let l = &self.ledger;
        metrics::gauge!(m::ADMISSION_QUEUE_LEN, "receiver" => self.label.clone())
            .set(l.admission_queue_len() as f64);
        metrics::gauge!(m::SLOTS_RESERVED, "receiver" => self.label.clone())
            .set(f64::from(l.reserved_unallocated()));
        metrics::gauge!(m::SLOTS_HELD, "receiver" => self.label.clone())
            .set(f64::from(l.held_slots()));
        metrics::gauge!(m::SLOTS_FREE, "receiver" => self.label.clone())
            .set(f64::from(l.free_slots()));
        metrics::gauge!(m::SLOTS_QUARANTINED, "receiver" => self.label.clone())
            .set(f64::from(l.quarantined_slots()));
        metrics::counter!(m::REFUSED, "receiver" => self.label.clone()).absolute(l.stats().refused);
        metrics::counter!(m::FABRIC_WRITES_REFUSED, "receiver" => self.label.clone())
            .absolute(self.listener.access.refused());
    }
}

/// A duration in whole milliseconds, saturating.
fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
