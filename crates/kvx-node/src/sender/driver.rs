//! The sender's driver task: it feeds the core what the transport and the fabric report
//! (replies, disconnects, write completions) and timers, and carries out what the core asks
//! for (messages, writes, events). Fabric connections and parked writes: `fabric_link`.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use kvx_io::{
    ClientEvent, Completion, ControlClient, Env, Fabric, FabricConn, FabricCredential, NotifySink,
    PostWrite, Transport,
};
use kvx_proto::sender::{Destination, SenderEvent, Transmit};
use kvx_proto::wire;
use kvx_proto::PeerId;
use tokio::sync::mpsc;

use super::{ReceiverAddr, RequestEnd, Shared};
use crate::start::StartError;

mod fabric_link;

/// Rounds of `carry_out` in a row before the loop listens for input again.
const CARRY_OUT_ROUNDS_MAX: usize = 16;

#[derive(Debug)]
pub(super) enum Cmd {
    AddReceiver(ReceiverAddr, ConnectReply),
    Connected(
        ReceiverAddr,
        PeerId,
        Result<ControlClient, StartError>,
        ConnectReply,
    ),
    /// A fabric connection attached with this credential.
    FabricBack(PeerId, FabricConn, FabricCredential),
    /// Connecting the fabric failed for good: writes waiting for it fail with the reason.
    FabricGaveUp(PeerId, kvx_io::FabricError),
}

/// Where an `add_receiver` call hears its outcome.
pub(super) type ConnectReply = tokio::sync::oneshot::Sender<Result<PeerId, StartError>>;

#[derive(Debug)]
enum Input {
    Client(PeerId, ClientEvent),
    /// A completion from connection generation `u64` to the peer.
    Done(PeerId, u64, Completion),
    /// That connection's completion stream ended: it is gone.
    ConnGone(PeerId, u64),
}

pub(super) struct Driver<E: Env> {
    env: E,
    shared: Arc<Shared>,
    memory: Arc<<E::Fabric as Fabric>::Memory>,
    local_id: String,
    sink: Option<NotifySink>,
    clients: BTreeMap<PeerId, mpsc::Sender<Bytes>>,
    /// `add_receiver` calls for a receiver whose connect is under way: answered when it
    /// ends, so that no caller gets a receiver id before its channel exists (a request
    /// begun on it would have its admission probe dropped).
    awaiting_connect: BTreeMap<PeerId, Vec<(ReceiverAddr, ConnectReply)>>,
    /// Receivers whose control channel is down (between the transport's `Disconnected` and
    /// `Reconnected`): what was sent to them before is lost (its requests failed when the
    /// `Disconnected` was processed).
    control_down: std::collections::BTreeSet<PeerId>,
    /// What requests begun while their receiver's channel was down (a restarted receiver
    /// the transport reconnects to) would send it, in order, with its `seq`: sent once the
    /// channel is back (`flush_due`), so that such a request waits for the reconnection
    /// instead of failing, bounded by the sender's reply timeout. Everything begun before
    /// the break has failed already, so nothing held is older than it.
    held: BTreeMap<PeerId, Vec<(Option<u64>, Bytes)>>,
    /// Receivers whose channel came back with messages held for it.
    flush_due: Vec<PeerId>,
    /// Receivers whose `Disconnected` has been processed (their requests failed) and not yet
    /// acknowledged to the transport (`kvx_io::DISCONNECT_ACK`), which drops everything sent
    /// to them until then.
    acks_due: Vec<PeerId>,
    /// A write completed since the allocate calls were last woken: they are woken once the
    /// round's writes are posted (`run`).
    staging_freed: bool,
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
    /// (`fabric_link`); at most one per submitted chunk.
    parked: BTreeMap<PeerId, Vec<(kvx_proto::ReqId, PostWrite)>>,
    /// Fabric writes posted for each request not yet ended (`SENDER_WRITES_PER_REQUEST`);
    /// bounded by the requests the flow tracks.
    writes_by_req: BTreeMap<kvx_proto::ReqId, u32>,
    /// When each write in flight was posted, for the write-latency metric. By write, not by
    /// staging slot: with caller staging several writes may read one slot, and the slots
    /// number every page of an engine's KV.
    write_started: BTreeMap<kvx_proto::WriteId, kvx_proto::Instant>,
    /// Receivers whose fabric has been attached before: attaching again is a reconnect.
    fabric_attached: std::collections::BTreeSet<PeerId>,
    /// The (request idle timeout, write quarantine) each receiver last stated, in ms.
    receiver_timeouts: BTreeMap<PeerId, (u64, u64)>,
    /// Receivers whose stated timeouts this sender's break: why, for each failed write.
    refused: BTreeMap<PeerId, String>,
    inbox_tx: mpsc::UnboundedSender<Input>,
    inbox: mpsc::UnboundedReceiver<Input>,
    cmds: mpsc::UnboundedReceiver<Cmd>,
    cmd_tx: mpsc::UnboundedSender<Cmd>,
    /// Dropped when the driver ends: how `SenderHandle::close` knows it has.
    alive: Option<tokio::sync::watch::Sender<()>>,
}

impl<E: Env> Driver<E> {
    pub(super) fn new(
        env: E,
        shared: Arc<Shared>,
        memory: Arc<<E::Fabric as Fabric>::Memory>,
        local_id: String,
        sink: Option<NotifySink>,
        cmds: mpsc::UnboundedReceiver<Cmd>,
        cmd_tx: mpsc::UnboundedSender<Cmd>,
    ) -> Self {
        let (inbox_tx, inbox) = mpsc::unbounded_channel();
        Self {
            env,
            shared,
            memory,
            local_id,
            sink,
            clients: BTreeMap::new(),
            awaiting_connect: BTreeMap::new(),
            control_down: Default::default(),
            held: BTreeMap::new(),
            flush_due: Vec::new(),
            acks_due: Vec::new(),
            staging_freed: false,
            conns: BTreeMap::new(),
            parked: BTreeMap::new(),
            writes_by_req: BTreeMap::new(),
            write_started: BTreeMap::new(),
            fabric_attached: Default::default(),
            receiver_timeouts: BTreeMap::new(),
            refused: BTreeMap::new(),
            conn_generation: 0,
            reconnecting: std::collections::BTreeSet::new(),
            connecting: std::collections::BTreeSet::new(),
            credentials: BTreeMap::new(),
            undecodable_logged: kvx_io::LogLimiter::default(),
            inbox_tx,
            inbox,
            cmds,
            cmd_tx,
            alive: None,
        }
    }

    pub(super) async fn run(mut self) {
        loop {
            // Carrying out one round (a flush of parked writes, a failed send) can give the
            // core more to send at once: repeat until it has nothing left, rather than leave
            // it for the next wake-up, which may be a timer seconds away. Bounded, and a
            // round still busy at the bound wakes the loop again.
            let mut busy = true;
            for _ in 0..CARRY_OUT_ROUNDS_MAX {
                busy = self.carry_out().await;
                if !busy {
                    break;
                }
            }
            if busy {
                self.shared.poke.notify_one();
            }
            // The allocate calls a completed write freed a slot for are woken only now, with
            // the writes it let the core post already posted: on a core shared with them, a
            // woken prefill thread takes the CPU from this task at once (woken mid-round,
            // two in three of the driver's context switches are that, on 2 cores, with its
            // writes waiting meanwhile).
            if std::mem::take(&mut self.staging_freed) {
                self.shared.wake_allocators();
            }
            let (deadline, shutdown) = {
                let core = self.shared.lock();
                (core.flow.poll_timeout(), core.shutdown)
            };
            if shutdown {
                self.write_out_notices().await;
                return;
            }
            let sleep = crate::deadline::sleep_until_deadline(&self.env, deadline);
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

    /// Holds `alive` until the driver ends.
    pub(super) fn holding(mut self, alive: tokio::sync::watch::Sender<()>) -> Self {
        self.alive = Some(alive);
        self
    }

    /// Closes the proxy channel and waits, at most `NOTICE_LINGER`, until what was queued
    /// on it is written.
    async fn write_out_notices(&mut self) {
        let Some(sink) = self.sink.take() else {
            return;
        };
        let deadline = self.env.now() + super::NOTICE_LINGER;
        tokio::select! {
            () = sink.close() => {}
            () = self.env.sleep_until(deadline) => {
                tracing::warn!(
                    linger = ?super::NOTICE_LINGER,
                    "stopping without the proxy taking the last notices"
                );
            }
        }
    }

    fn on_input(&mut self, input: Input) {
        let now = self.env.now();
        let mut core = self.shared.lock();
        match input {
            Input::Client(peer, ClientEvent::Message(bytes)) => match wire::decode(&bytes) {
                Ok(msg) => {
                    let (credential, timeouts) = match &msg {
                        wire::Message::AllocResponse(r) => (
                            r.fabric_credential.clone(),
                            r.request_idle_timeout_ms.zip(r.write_quarantine_ms),
                        ),
                        _ => (None, None),
                    };
                    core.flow.handle_message(now, peer, msg);
                    let ours = core.flow.config().clone();
                    drop(core);
                    if let Some(t) = timeouts {
                        self.check_receiver_timeouts(peer, t, &ours);
                    }
                    if let Some(text) = credential {
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
                // Their requests have just failed with the rest.
                self.held.remove(&peer);
                self.acks_due.push(peer);
            }
            // The receiver may have restarted: its fabric endpoint is a new listener, so the
            // old fabric connection is dead too, and its credential may be void. Replace the
            // connection once the receiver's next reply brings a credential.
            Input::Client(peer, ClientEvent::Reconnected) => {
                metrics::counter!(crate::metrics::SENDER_RECONNECTS, "channel" => "control")
                    .increment(1);
                self.control_down.remove(&peer);
                drop(core);
                if self.held.contains_key(&peer) {
                    self.flush_due.push(peer);
                }
                self.credentials.remove(&peer);
                self.reset_fabric(peer);
            }
            Input::Done(peer, generation, c) => {
                write_done(&mut self.write_started, c.id, c.result.is_ok(), now);
                let broken = matches!(
                    c.result,
                    Err(kvx_io::FabricError::Flushed
                        | kvx_io::FabricError::Closed
                        | kvx_io::FabricError::Io(_))
                );
                core.flow
                    .handle_write_done(now, c.id, c.result.map_err(|e| e.to_string()));
                // A completed write frees a staging slot without any core event: the
                // allocate calls waiting for one are woken after this round (`run`), and
                // no one else (a request it completes is an event, which wakes its own).
                drop(core);
                self.staging_freed = true;
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

    fn on_cmd(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::AddReceiver(addr, reply) => {
                let mut core = self.shared.lock();
                if let Some(&peer) = core.receivers.get(&addr) {
                    drop(core);
                    if self.clients.contains_key(&peer) {
                        let _ = reply.send(Ok(peer));
                    } else {
                        self.awaiting_connect
                            .entry(peer)
                            .or_default()
                            .push((addr, reply));
                    }
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
            Cmd::Connected(addr, peer, result, reply) => {
                let waiting = self.awaiting_connect.remove(&peer).unwrap_or_default();
                match result {
                    Ok(client) => {
                        self.attach_client(peer, client);
                        let _ = reply.send(Ok(peer));
                        for (_, reply) in waiting {
                            let _ = reply.send(Ok(peer));
                        }
                    }
                    Err(e) => {
                        self.shared.lock().receivers.remove(&addr);
                        let _ = reply.send(Err(e));
                        // Each waiting call makes an attempt of its own (the first starts
                        // a new connect, the others wait for it again).
                        for (addr, reply) in waiting {
                            self.on_cmd(Cmd::AddReceiver(addr, reply));
                        }
                    }
                }
            }
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

    /// Does what the core asked for; false when it had asked for nothing.
    async fn carry_out(&mut self) -> bool {
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
        let asked = !(transmits.is_empty() && writes.is_empty() && events.is_empty());
        if asked {
            self.record_gauges();
        }
        // Acknowledge processed disconnects before anything else reaches those receivers.
        for peer in std::mem::take(&mut self.acks_due) {
            if let Some(client) = self.clients.get(&peer) {
                let _ = client.send(kvx_io::DISCONNECT_ACK).await;
            }
        }
        // Then what waited for a channel that is back, before anything newer.
        for peer in std::mem::take(&mut self.flush_due) {
            self.flush_held(peer).await;
        }
        for t in transmits {
            self.transmit(t).await;
        }
        if !writes.is_empty() {
            self.post_all(writes);
        }
        if !events.is_empty() {
            self.on_events(events);
        }
        asked
    }

    async fn transmit(&mut self, t: Transmit) {
        let bytes = Bytes::from(wire::encode(&t.msg));
        match t.to {
            Destination::Receiver(peer) => {
                let Some(client) = self.clients.get(&peer) else {
                    // No channel to it (an id `add_receiver` never returned): what it was
                    // sent would be lost without a word; its requests fail at once.
                    let now = self.env.now();
                    self.shared.lock().flow.handle_receiver_lost(now, peer);
                    return;
                };
                // The transport drops what it is handed while reconnecting: a request begun
                // since the break waits for the channel to come back (`held`).
                if self.control_down.contains(&peer) {
                    let seq = match &t.msg {
                        wire::Message::AllocRequest(r) => r.seq,
                        wire::Message::CancelNotif(c) => c.seq,
                        _ => None,
                    };
                    self.held.entry(peer).or_default().push((seq, bytes));
                    return;
                }
                if client.send(bytes).await.is_err() {
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

    /// Sends what was held for `peer` while its channel was down, in order, leaving out the
    /// messages whose reply the core no longer awaits (the reply timeout reset the channel
    /// meanwhile: a reply to them would be taken for a newer message's on a serial
    /// channel). Whether the message's *request* still runs does not matter: the cancel of
    /// a request that ended is in flight all the same, and a channel still probing admits
    /// nothing else until its reply comes (found by `receiver_restart_mid_run`: a request
    /// begun during the reconnection once waited out the reply timeout behind a cancel held
    /// and never sent).
    async fn flush_held(&mut self, peer: PeerId) {
        let Some(held) = self.held.remove(&peer) else {
            return;
        };
        let Some(client) = self.clients.get(&peer) else {
            return;
        };
        for (seq, bytes) in held {
            let awaited = seq.is_none_or(|seq| self.shared.lock().flow.awaits_reply(peer, seq));
            if awaited && client.send(bytes).await.is_err() {
                let now = self.env.now();
                self.shared.lock().flow.handle_receiver_lost(now, peer);
                return;
            }
        }
    }

    /// Checks this sender's timeouts against those a receiver states (`check_sender`, a
    /// rule that spans the two processes): writes to a receiver they break fail at once with
    /// the reason (a slow write could otherwise land after the receiver reused its slot),
    /// logged once, until the receiver states timeouts they keep.
    fn check_receiver_timeouts(
        &mut self,
        peer: PeerId,
        (idle_ms, quarantine_ms): (u64, u64),
        ours: &kvx_proto::SenderConfig,
    ) {
        if self.receiver_timeouts.get(&peer) == Some(&(idle_ms, quarantine_ms)) {
            return;
        }
        self.receiver_timeouts
            .insert(peer, (idle_ms, quarantine_ms));
        let theirs = kvx_proto::ReceiverConfig {
            request_idle_timeout: std::time::Duration::from_millis(idle_ms),
            write_quarantine: std::time::Duration::from_millis(quarantine_ms),
            ..kvx_proto::ReceiverConfig::default()
        };
        match theirs.check_sender(ours) {
            Ok(()) => {
                self.refused.remove(&peer);
            }
            Err(e) => {
                let why = format!("this sender's timeouts do not fit the receiver's: {}", e.0);
                tracing::error!(%peer, "{why}; writes to it fail until they do");
                metrics::counter!(crate::metrics::SENDER_CONFIG_CONFLICTS).increment(1);
                self.refused.insert(peer, why);
            }
        }
    }

    /// The staging and request gauges, read from the core.
    fn record_gauges(&self) {
        let (free, capacity, requests, waiting) = {
            let core = self.shared.lock();
            (
                core.flow.staging_free(),
                core.flow.staging_capacity(),
                core.flow.tracked_requests(),
                core.begun_at.len(),
            )
        };
        metrics::gauge!(crate::metrics::SENDER_STAGING_FREE).set(f64::from(free));
        metrics::gauge!(crate::metrics::SENDER_STAGING_HELD).set(f64::from(capacity - free));
        metrics::gauge!(crate::metrics::SENDER_REQUESTS, "state" => "awaiting_admission")
            .set(waiting as f64);
        metrics::gauge!(crate::metrics::SENDER_REQUESTS, "state" => "admitted")
            .set(requests.saturating_sub(waiting) as f64);
    }

    /// Notes that write `id` was posted.
    fn write_posted(&mut self, id: kvx_proto::WriteId) {
        self.write_started.insert(id, self.env.now());
    }

    fn on_events(&mut self, events: Vec<SenderEvent>) {
        let mut stalled = Vec::new();
        self.shared.wake_for(&events);
        for ev in events {
            match ev {
                // Waiters read admission and outcomes from the core, woken below.
                SenderEvent::Admitted { req_id } => {
                    let begun = self.shared.lock().begun_at.remove(&req_id);
                    if let Some(at) = begun {
                        let waited = self.env.now().saturating_since(at);
                        metrics::histogram!(crate::metrics::SENDER_ADMISSION_WAIT_SECONDS)
                            .record(waited.as_secs_f64());
                    }
                }
                SenderEvent::Delivered { req_id } => {
                    self.shared.lock().begun_at.remove(&req_id);
                    let writes = self.writes_by_req.remove(&req_id).unwrap_or(0);
                    metrics::histogram!(crate::metrics::SENDER_WRITES_PER_REQUEST)
                        .record(f64::from(writes));
                    metrics::counter!(crate::metrics::SENDER_DELIVERED).increment(1);
                    self.shared.complete(RequestEnd {
                        req_id,
                        outcome: Ok(()),
                    });
                }
                SenderEvent::Failed { req_id, failure } => {
                    self.shared.lock().begun_at.remove(&req_id);
                    self.writes_by_req.remove(&req_id);
                    metrics::counter!(crate::metrics::SENDER_FAILED, "reason" => failure.kind())
                        .increment(1);
                    tracing::info!(%req_id, %failure, "request failed");
                    self.shared.complete(RequestEnd {
                        req_id,
                        outcome: Err(failure),
                    });
                }
                SenderEvent::ChannelReset { receiver } => {
                    tracing::warn!(%receiver, "control channel reset; the transport reconnects");
                }
                SenderEvent::Drained { req_id } => {
                    tracing::debug!(%req_id, "failed request drained: its staging is read no more");
                }
                SenderEvent::FabricStalled { receiver } => stalled.push(receiver),
            }
        }
        for receiver in stalled {
            self.flush_parked(receiver, "write overdue while the fabric reconnects");
            self.reset_fabric(receiver);
        }
    }
}

impl<E: Env> Drop for Driver<E> {
    /// However the driver ends (it returned, panicked, or its runtime went away), every call
    /// waiting on it learns now, not at its timeout: `alive` closes (the async waits hear
    /// that) and the blocked threads are woken (they see the driver gone and answer
    /// `Stopped`).
    fn drop(&mut self) {
        drop(self.alive.take());
        self.shared.wake_all();
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

/// Records write `id`'s latency when it succeeded; forgets it either way.
fn write_done(
    started: &mut BTreeMap<kvx_proto::WriteId, kvx_proto::Instant>,
    id: kvx_proto::WriteId,
    ok: bool,
    now: kvx_proto::Instant,
) {
    if let Some(at) = started.remove(&id) {
        if ok {
            metrics::histogram!(crate::metrics::SENDER_WRITE_SECONDS)
                .record(now.saturating_since(at).as_secs_f64());
        }
    }
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
