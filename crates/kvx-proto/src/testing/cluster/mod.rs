//! The harness event loop. See the module map in `testing/mod.rs`.
//!
//! - `apps.rs`: the prefill engine and decoder models.
//! - `settle.rs`: per-step and final checks, the stuck dump, trace lines.

mod apps;
mod settle;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use super::checker::{content_of, Checker, Violation};
use super::workload::ClusterSpec;
use crate::ids::{PeerId, ReqId, ReqKey, SlotIndex, WriteId, WriteTag};
use crate::proxy::{ProxyEvent, ProxyTracker};
use crate::receiver::{ChecksumCheck, LandedWrite, Outcome, ReceiverEvent, ReceiverLedger};
use crate::rng::SeededRng;
use crate::sender::{
    ChunkSpec, Destination, RequestSpec, SendError, SenderEvent, SenderFlow, WriteOp,
};
use crate::slots::SlotGrant;
use crate::time::Instant;
use crate::wire::{self, Message};

/// How a request ended at its sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// `SenderEvent::Delivered`.
    Delivered,
    /// `SenderEvent::Failed`, with the failure in words.
    Failed(String),
}

/// What happened to one planned request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanReport {
    /// When its sender began it (`handle_begin`).
    pub begun_at: Option<Instant>,
    /// When its sender saw it admitted.
    pub admitted_at: Option<Instant>,
    /// When its receiver reserved its slots (`ReceiverEvent::Admitted`): the start of its
    /// hold on the buffer, for measuring who holds how much of it over time.
    pub reserved_at: Option<Instant>,
    /// Slots its receiver reserved then (its declared `total_chunks`).
    pub reserved_slots: u32,
    /// How long its first batch waited in its receiver's admission queue before that.
    pub queued_for: Option<Duration>,
    /// When its receiver ended it (`ReceiverEvent::Ended`), which gives back what is left of
    /// its reservation (a last batch bringing fewer chunks than declared gives back the
    /// difference earlier).
    pub released_at: Option<Instant>,
    /// When it ended at its sender.
    pub ended_at: Option<Instant>,
    /// How it ended at its sender.
    pub sender_end: Option<End>,
    /// `Ok` when the proxy saw every notice, `Err(reason)` on a failure notice or timeout.
    pub proxy_end: Option<Result<Instant, String>>,
    /// How it ended at its receiver.
    pub receiver_end: Option<Outcome>,
    /// When the decoder consumed it.
    pub consumed_at: Option<Instant>,
    /// Chunks the decoder read and checked.
    pub chunks_verified: u32,
}

/// The result of a run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// One per `ClusterSpec::requests`, in the same order.
    pub plans: Vec<PlanReport>,
    /// Events handled.
    pub steps: u64,
    /// Virtual time when the run settled.
    pub finished_at: Instant,
    /// Replies received by raw peers (injected messages).
    pub raw_replies: Vec<(PeerId, Message)>,
    /// ProxyNotif messages the proxy received, per request id.
    pub proxy_notifs: BTreeMap<String, u32>,
    /// Writes the fabric refused because their sender held no current grant for the slot.
    pub refused_writes: u64,
}

impl Report {
    /// Time from the first request's begin to the last request's end at the proxy.
    pub fn makespan(&self) -> Duration {
        let start = self
            .plans
            .iter()
            .filter_map(|p| p.begun_at)
            .min()
            .unwrap_or_default();
        let end = self
            .plans
            .iter()
            .filter_map(|p| p.proxy_end.clone()?.ok())
            .max()
            .unwrap_or_default();
        end - start
    }

    /// Requests delivered at their sender.
    pub fn delivered(&self) -> usize {
        self.plans
            .iter()
            .filter(|p| p.sender_end == Some(End::Delivered))
            .count()
    }
}

/// The run did not settle, or a checker fired. `dump` says what was outstanding.
#[derive(Debug, Clone)]
pub struct Stuck {
    /// Why the run stopped: a bound reached, or the checker's violation.
    pub reason: String,
    /// Every node's outstanding state, for the failure message.
    pub dump: String,
    /// What happened up to then.
    pub report: Box<Report>,
}

impl fmt::Display for Stuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\n{}", self.reason, self.dump)
    }
}

#[derive(Debug, Clone)]
enum Ev {
    Start(usize),
    ToReceiver {
        from: PeerId,
        r: usize,
        bytes: Vec<u8>,
    },
    ToSender {
        r: usize,
        s: usize,
        bytes: Vec<u8>,
    },
    ToRaw {
        peer: PeerId,
        bytes: Vec<u8>,
    },
    ToProxy {
        bytes: Vec<u8>,
    },
    WriteLands {
        s: usize,
        op: WriteOp,
        fail: bool,
        posted: Instant,
    },
    Tick(usize),
    Consume {
        r: usize,
        key: ReqKey,
    },
    Cancel(usize),
    Kill(usize),
}

#[derive(Debug)]
struct SenderNode {
    flow: SenderFlow,
    alive: bool,
    staging_mem: Vec<u64>,
    waiting: VecDeque<usize>,
    active: Vec<usize>,
    tick_at: Option<Instant>,
    busy_until: Instant,
}

#[derive(Debug)]
struct ReceiverNode {
    ledger: ReceiverLedger,
    /// The fabric's mirror of the ledger's grants (`poll_grant_change`): a write lands only
    /// where its sender holds the current grant, as the TCP and shared-memory fabrics check.
    grants: Vec<Option<SlotGrant>>,
    mem: Vec<u64>,
    ready: BTreeMap<ReqKey, Vec<SlotIndex>>,
}

#[derive(Debug, Default)]
struct PlanRun {
    next_chunk: u32,
    batch: Vec<ChunkSpec>,
    done_submitting: bool,
    proxy_ready: bool,
}

/// Peer ids of raw (injected) senders start here, above every real sender.
pub const RAW_PEER_BASE: u64 = 1_000;

/// One FIFO link of the harness's network: what is sent on a link arrives in the order it was
/// sent (as on one TCP connection or ZMQ pipe), and links do not wait for each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Link {
    /// Sender `s`'s alloc channel to a receiver: requests and cancels.
    Control { s: usize, receiver: PeerId },
    /// Sender `s`'s notice channel to the proxy.
    Notify { s: usize },
    /// Sender `s`'s fabric connection to a receiver: one write at a time, each taking its
    /// write time; a fabric reset forgets the link's backlog.
    Fabric { s: usize, receiver: PeerId },
    /// Receiver `r`'s replies to one peer (a sender or a raw peer).
    Reply { r: usize, peer: PeerId },
}

/// Senders, receivers and a proxy, driven as the production drivers drive them, over FIFO
/// links with latency and jitter in virtual time, running a `ClusterSpec`'s workload with a
/// prefill engine and a decoder of its own (`apps.rs`). Deterministic for a given spec.
#[derive(Debug)]
pub struct Cluster {
    spec: ClusterSpec,
    now: Instant,
    queue: BTreeMap<(Instant, u64), Ev>,
    seq: u64,
    link_free_at: BTreeMap<Link, Instant>,
    rng: SeededRng,
    senders: Vec<SenderNode>,
    receivers: Vec<ReceiverNode>,
    proxy: ProxyTracker,
    runs: Vec<PlanRun>,
    report: Report,
    checker: Checker,
    by_req_id: BTreeMap<String, usize>,
    /// Print every event to stderr (set `KVX_TRACE=1`).
    trace: bool,
}

impl Cluster {
    /// Builds the cluster. Panics on a deployment `ReceiverConfig::check_sender` refuses:
    /// the harness tests the protocol under valid settings.
    pub fn new(spec: ClusterSpec) -> Self {
        for receiver in &spec.receivers {
            for sender in &spec.senders {
                if let Err(e) = receiver.check_sender(sender) {
                    panic!("harness: {e}");
                }
            }
            if let Err(e) = receiver.check_proxy(&spec.proxy) {
                panic!("harness: {e}");
            }
        }
        let senders = spec
            .senders
            .iter()
            .map(|cfg| SenderNode {
                flow: SenderFlow::new(cfg.clone()).expect("harness: valid sender config"),
                alive: true,
                staging_mem: vec![0; cfg.staging_slots as usize],
                waiting: VecDeque::new(),
                active: Vec::new(),
                tick_at: None,
                busy_until: Instant::ZERO,
            })
            .collect();
        let receivers = spec
            .receivers
            .iter()
            .map(|cfg| ReceiverNode {
                ledger: ReceiverLedger::new(cfg.clone()).expect("harness: valid receiver config"),
                grants: vec![None; cfg.buffer_slots as usize],
                mem: vec![0; cfg.buffer_slots as usize],
                ready: BTreeMap::new(),
            })
            .collect();
        let mut cluster = Cluster {
            proxy: ProxyTracker::new(spec.proxy.clone()).expect("harness: valid proxy config"),
            now: Instant::ZERO,
            queue: BTreeMap::new(),
            seq: 0,
            link_free_at: BTreeMap::new(),
            // Not `SeededRng::new`: the scenarios' kept seeds were found on this state.
            rng: SeededRng::from_state(spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            senders,
            receivers,
            runs: spec.requests.iter().map(|_| PlanRun::default()).collect(),
            report: Report {
                plans: vec![PlanReport::default(); spec.requests.len()],
                ..Report::default()
            },
            checker: Checker::default(),
            by_req_id: spec
                .requests
                .iter()
                .enumerate()
                .map(|(i, p)| (p.req_id.clone(), i))
                .collect(),
            spec,
            trace: std::env::var_os("KVX_TRACE").is_some(),
        };
        for (i, plan) in cluster.spec.requests.clone().iter().enumerate() {
            cluster.schedule(Instant::ZERO + plan.start_after, Ev::Start(i));
        }
        for (s, after) in cluster.spec.kill_sender_after.clone() {
            cluster.schedule(Instant::ZERO + after, Ev::Kill(s));
        }
        cluster
    }

    /// Sends `msg` from a raw peer (not a real sender) to receiver `r` at `at`; replies are
    /// collected in `Report::raw_replies`.
    pub fn inject(&mut self, at: Duration, raw: u64, r: usize, msg: &Message) {
        let from = PeerId(RAW_PEER_BASE + raw);
        self.schedule(
            Instant::ZERO + at,
            Ev::ToReceiver {
                from,
                r,
                bytes: wire::encode(msg),
            },
        );
    }

    /// Receiver `r`'s ledger.
    pub fn receiver(&self, r: usize) -> &ReceiverLedger {
        &self.receivers[r].ledger
    }

    /// Sender `s`'s flow.
    pub fn sender(&self, s: usize) -> &SenderFlow {
        &self.senders[s].flow
    }

    /// The virtual time of the last step.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Runs until nothing is left to do, at most `max_steps` events and `max_time` of virtual
    /// time. Every node's invariants and the global checks run after every step.
    pub fn run(mut self, max_steps: u64, max_time: Duration) -> Result<Report, Stuck> {
        let limit = Instant::ZERO + max_time;
        while let Some(at) = self.next_time() {
            if at > limit || self.report.steps >= max_steps {
                let why = format!(
                    "did not settle within {max_steps} steps and {max_time:?} of virtual time"
                );
                return Err(self.stuck(why));
            }
            self.now = at;
            self.report.steps += 1;
            self.step();
            if let Err(v) = self.check() {
                return Err(self.stuck(format!("checker: {v}")));
            }
        }
        if let Err(v) = self.check_final() {
            return Err(self.stuck(format!("final check: {v}")));
        }
        self.report.finished_at = self.now;
        Ok(self.report)
    }

    fn next_time(&self) -> Option<Instant> {
        let mut t = self.queue.keys().next().map(|k| k.0);
        let mut consider = |d: Option<Instant>| {
            if let Some(d) = d {
                t = Some(t.map_or(d, |x: Instant| x.min(d)));
            }
        };
        for node in self.senders.iter().filter(|n| n.alive) {
            consider(node.flow.poll_timeout());
        }
        for node in &self.receivers {
            consider(node.ledger.poll_timeout());
        }
        consider(self.proxy.poll_timeout());
        t.map(|t| t.max(self.now))
    }

    fn step(&mut self) {
        let now = self.now;
        if let Some(&key) = self.queue.keys().next().filter(|k| k.0 <= now) {
            let ev = self.queue.remove(&key).expect("harness: key just seen");
            if self.trace {
                eprintln!("{:>12?} {}", now.since_epoch(), settle::describe(&ev));
            }
            self.handle(ev);
        } else {
            for s in 0..self.senders.len() {
                if self.senders[s].alive
                    && self.senders[s]
                        .flow
                        .poll_timeout()
                        .is_some_and(|t| t <= now)
                {
                    self.senders[s].flow.handle_timeout(now);
                    self.drain_sender(s);
                }
            }
            for r in 0..self.receivers.len() {
                if self.receivers[r]
                    .ledger
                    .poll_timeout()
                    .is_some_and(|t| t <= now)
                {
                    self.receivers[r].ledger.handle_timeout(now);
                    self.drain_receiver(r);
                }
            }
            if self.proxy.poll_timeout().is_some_and(|t| t <= now) {
                self.proxy.handle_timeout(now);
                self.drain_proxy();
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Start(i) => {
                let s = self.spec.requests[i].sender;
                self.senders[s].waiting.push_back(i);
                self.schedule_tick(s);
            }
            Ev::ToReceiver { from, r, bytes } => {
                if from.0 < RAW_PEER_BASE && !self.senders[from.0 as usize].alive {
                    return;
                }
                let msg = wire::decode(&bytes).expect("harness: the codec decodes what it encoded");
                self.receivers[r].ledger.handle_message(now, from, msg);
                self.drain_receiver(r);
            }
            Ev::ToSender { r, s, bytes } => {
                if !self.senders[s].alive {
                    return;
                }
                let msg = wire::decode(&bytes).expect("harness: the codec decodes what it encoded");
                self.senders[s]
                    .flow
                    .handle_message(now, PeerId(r as u64), msg);
                self.drain_sender(s);
            }
            Ev::ToRaw { peer, bytes } => {
                let msg = wire::decode(&bytes).expect("harness: the codec decodes what it encoded");
                self.report.raw_replies.push((peer, msg));
            }
            Ev::ToProxy { bytes } => {
                let msg = wire::decode(&bytes).expect("harness: the codec decodes what it encoded");
                if let Message::ProxyNotif(n) = &msg {
                    *self
                        .report
                        .proxy_notifs
                        .entry(n.req_id.clone())
                        .or_default() += 1;
                    self.checker.on_proxy_notif(&n.req_id);
                }
                // Every request is awaited from one rank, so one connection stands for all.
                let from = crate::proxy::NoticeFrom::connection(0);
                self.proxy.handle_message(now, from, msg);
                self.drain_proxy();
            }
            Ev::WriteLands {
                s,
                op,
                fail,
                posted,
            } => {
                // A dead sender's kernel tears its connections down: only writes that
                // complete within its write_timeout of posting may still land.
                let cut = !self.senders[s].alive
                    && self.now > posted + self.spec.senders[s].write_timeout;
                if !cut {
                    self.land(s, op, fail);
                }
            }
            Ev::Tick(s) => {
                self.senders[s].tick_at = None;
                if self.senders[s].alive {
                    self.prefill(s);
                }
            }
            Ev::Consume { r, key } => self.consume(r, key),
            Ev::Cancel(i) => {
                let s = self.spec.requests[i].sender;
                if self.senders[s].alive && self.report.plans[i].sender_end.is_none() {
                    let req_id = ReqId(self.spec.requests[i].req_id.clone());
                    // Unknown means it already ended on the sender: a harmless race.
                    let _ = self.senders[s].flow.handle_cancel(now, &req_id);
                    self.drain_sender(s);
                }
            }
            Ev::Kill(s) => {
                self.senders[s].alive = false;
                let node = &mut self.senders[s];
                node.waiting.clear();
                node.active.clear();
            }
        }
    }

    /// One-sided write: the bytes are read from staging when they land (a DMA reads its
    /// source during the transfer, so a staging slot reused too early shows up as corrupt).
    fn land(&mut self, s: usize, op: WriteOp, fail: bool) {
        let now = self.now;
        let r = op.receiver.0 as usize;
        let peer = PeerId(s as u64);
        let granted = op.tag.is_none_or(|tag| {
            self.receivers[r].grants[op.remote.0 as usize].is_some_and(|g| {
                g.peer == peer
                    && tag.same_grant(WriteTag {
                        slot: op.remote,
                        generation: g.generation,
                    })
            })
        });
        let refused = !fail && !granted;
        if refused {
            self.report.refused_writes += 1;
        }
        if !fail && granted {
            let bytes = self.senders[s].staging_mem[op.staging.0 as usize];
            let key = ReqKey {
                peer,
                req_id: op.req_id.clone(),
            };
            self.checker.on_write(&self.receivers[r].ledger, &key, &op);
            self.receivers[r].mem[op.remote.0 as usize] = bytes;
            if let Some(tag) = op.tag {
                let landed = LandedWrite {
                    peer,
                    slot: op.remote,
                    tag,
                    bytes: 1,
                    checksum: ChecksumCheck::Match,
                };
                self.receivers[r].ledger.handle_chunk_landed(now, landed);
                self.drain_receiver(r);
            }
        }
        if self.senders[s].alive {
            let result = if fail {
                Err("injected fabric error".to_owned())
            } else if refused {
                Err("refused: the receiver's fabric holds no grant for this write".to_owned())
            } else {
                Ok(())
            };
            self.senders[s].flow.handle_write_done(now, op.id, result);
            self.drain_sender(s);
        }
    }

    /// What a driver does on `FabricStalled`: reset the connection, which flushes every
    /// outstanding write on it with an error (verbs: the QP goes to error; nothing lands
    /// after the flush).
    fn reset_fabric(&mut self, s: usize, receiver: u64) {
        let flushed: Vec<(Instant, u64)> = self
            .queue
            .iter()
            .filter(|(_, ev)| matches!(ev, Ev::WriteLands { s: ws, op, .. } if *ws == s && op.receiver.0 == receiver))
            .map(|(k, _)| *k)
            .collect();
        for key in flushed {
            if let Some(Ev::WriteLands { s, op, posted, .. }) = self.queue.remove(&key) {
                let now = self.now;
                self.schedule(
                    now,
                    Ev::WriteLands {
                        s,
                        op,
                        fail: true,
                        posted,
                    },
                );
            }
        }
        self.link_free_at.remove(&Link::Fabric {
            s,
            receiver: PeerId(receiver),
        });
    }

    fn drain_sender(&mut self, s: usize) {
        let now = self.now;
        while let Some(t) = self.senders[s].flow.poll_transmit() {
            let bytes = wire::encode(&t.msg);
            match t.to {
                Destination::Receiver(r) => {
                    let link = Link::Control { s, receiver: r };
                    let at = self.link_time(link, self.spec.timing.net_latency);
                    self.schedule(
                        at,
                        Ev::ToReceiver {
                            from: PeerId(s as u64),
                            r: r.0 as usize,
                            bytes,
                        },
                    );
                }
                Destination::Proxy => {
                    let at = self.link_time(Link::Notify { s }, self.spec.timing.net_latency);
                    self.schedule(at, Ev::ToProxy { bytes });
                }
            }
        }
        while let Some(op) = self.senders[s].flow.poll_write() {
            let i = self.by_req_id[&op.req_id.0];
            let fail = self.spec.requests[i].fail_write_of_chunk == Some(op.chunk);
            let write_time = self.spec.requests[i]
                .write_time
                .unwrap_or(self.spec.timing.write_time);
            let link = Link::Fabric {
                s,
                receiver: op.receiver,
            };
            let start = self
                .link_free_at
                .get(&link)
                .copied()
                .unwrap_or(now)
                .max(now);
            self.link_free_at.insert(link, start + write_time);
            self.schedule(
                start + write_time,
                Ev::WriteLands {
                    s,
                    op,
                    fail,
                    posted: now,
                },
            );
        }
        while let Some(ev) = self.senders[s].flow.poll_event() {
            match ev {
                SenderEvent::Admitted { req_id } => {
                    let i = self.by_req_id[&req_id.0];
                    self.report.plans[i].admitted_at = Some(now);
                    self.schedule_tick(s);
                }
                SenderEvent::Delivered { req_id } => {
                    let i = self.by_req_id[&req_id.0];
                    self.checker
                        .on_delivered(&req_id.0, self.spec.requests[i].chunks);
                    self.end_plan(i, End::Delivered);
                }
                SenderEvent::Failed { req_id, failure } => {
                    self.end_plan(self.by_req_id[&req_id.0], End::Failed(failure.to_string()))
                }
                SenderEvent::FabricStalled { receiver } => self.reset_fabric(s, receiver.0),
                // The harness's senders stage in kvx's pool: never raised there.
                SenderEvent::ChannelReset { .. } | SenderEvent::Drained { .. } => {}
            }
        }
        // Staging may have been freed: the engine may continue.
        if !self.senders[s].active.is_empty() || !self.senders[s].waiting.is_empty() {
            self.schedule_tick(s);
        }
    }

    fn drain_receiver(&mut self, r: usize) {
        // Grants first: a reply hands them out, and the fabric must know them by then.
        while let Some(change) = self.receivers[r].ledger.poll_grant_change() {
            self.receivers[r].grants[change.slot.0 as usize] = change.grant;
        }
        while let Some((peer, reply)) = self.receivers[r].ledger.poll_transmit() {
            let bytes = wire::encode(&Message::AllocResponse(reply));
            let at = self.link_time(Link::Reply { r, peer }, self.spec.timing.net_latency);
            let ev = if peer.0 >= RAW_PEER_BASE {
                Ev::ToRaw { peer, bytes }
            } else {
                Ev::ToSender {
                    r,
                    s: peer.0 as usize,
                    bytes,
                }
            };
            self.schedule(at, ev);
        }
        while let Some(ev) = self.receivers[r].ledger.poll_event() {
            match ev {
                ReceiverEvent::Admitted {
                    key,
                    total_chunks,
                    waited,
                } => {
                    if let Some(i) = self.plan_of(&key) {
                        let plan = &mut self.report.plans[i];
                        plan.reserved_at = Some(self.now);
                        plan.reserved_slots = total_chunks;
                        plan.queued_for = Some(waited);
                    }
                }
                ReceiverEvent::Ready { key, slots, .. } => {
                    self.receivers[r].ready.insert(key.clone(), slots);
                    self.maybe_consume(r, &key);
                }
                ReceiverEvent::Ended { key, outcome } => {
                    self.receivers[r].ready.remove(&key);
                    self.checker.on_receiver_end(&key, &outcome);
                    if let Some(i) = self.plan_of(&key) {
                        self.report.plans[i].receiver_end = Some(outcome);
                        self.report.plans[i].released_at = Some(self.now);
                    }
                }
                // The cluster's receivers place requests themselves (`Placement::Pool`).
                ReceiverEvent::Returned { req_id, .. } => {
                    panic!("reservation {} returned by a pool receiver", req_id.0)
                }
            }
        }
    }

    /// The planned request a receiver's key names (a raw peer's request of the same id is
    /// not it).
    fn plan_of(&self, key: &ReqKey) -> Option<usize> {
        let &i = self.by_req_id.get(&key.req_id.0)?;
        (key.peer.0 == self.spec.requests[i].sender as u64).then_some(i)
    }

    fn drain_proxy(&mut self) {
        while let Some(ev) = self.proxy.poll_event() {
            let (req_id, end) = match ev {
                ProxyEvent::Ready { req_id } => (req_id, Ok(self.now)),
                ProxyEvent::Failed { req_id, failure } => (req_id, Err(failure.to_string())),
            };
            let Some(&i) = self.by_req_id.get(&req_id.0) else {
                continue;
            };
            self.checker
                .on_proxy_end(&req_id.0, self.report.plans[i].proxy_end.is_some());
            let ready = end.is_ok();
            self.report.plans[i].proxy_end = Some(end);
            if ready {
                self.runs[i].proxy_ready = true;
                let plan = &self.spec.requests[i];
                let key = ReqKey {
                    peer: PeerId(plan.sender as u64),
                    req_id,
                };
                self.maybe_consume(plan.receiver, &key);
            }
        }
    }

    /// When a message sent now on `link` arrives: latency plus jitter, never before an
    /// earlier message of the same link (links are FIFO, as TCP and ZMQ are).
    fn link_time(&mut self, link: Link, latency: Duration) -> Instant {
        let jitter = self.spec.timing.jitter;
        let extra = if jitter.is_zero() {
            Duration::ZERO
        } else {
            jitter.mul_f64(self.rng.unit())
        };
        let at = self.now + latency + extra;
        let at = self
            .link_free_at
            .get(&link)
            .map_or(at, |&prev| at.max(prev));
        self.link_free_at.insert(link, at);
        at
    }

    fn schedule(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }
}
