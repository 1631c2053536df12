//! What one simulated run is: the topology (prefill workers × TP ranks of senders, decode
//! workers × TP ranks of receivers, one proxy), every node's configuration, the timing of the
//! world, the requests and the faults. `plan::random` draws one from a seed; scenarios build
//! one by hand from `SimConfig::new`.

use std::time::Duration;

use kvx_proto::{ProxyConfig, ReceiverConfig, SenderConfig};

pub const PROXY_ENDPOINT: &str = "proxy/notify";

/// The node of prefill worker `p`'s TP rank `rank`.
pub fn sender_node(p: usize, rank: usize) -> String {
    format!("p{p}r{rank}")
}

/// The node of decode worker `d`'s TP rank `rank`.
pub fn receiver_node(d: usize, rank: usize) -> String {
    format!("d{d}r{rank}")
}

#[derive(Debug, Clone, PartialEq)]
pub struct PrefillWorker {
    pub sender: SenderConfig,
    /// Requests its engine prefills at once.
    pub interleave: usize,
    /// The engine asks for staging right after `begin` (the core holds it back until the
    /// request is admitted) instead of awaiting `admitted` first. Both are valid uses.
    pub allocate_first: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DecodeWorker {
    pub receiver: ReceiverConfig,
}

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestPlan {
    pub id: String,
    pub start_at: Duration,
    pub prefill: usize,
    pub decode: usize,
    /// Chunks each rank sends, and the total each rank declares (larger: LMCache W13).
    pub chunks: u32,
    pub declared: u32,
    pub batch_chunks: u32,
    /// The client aborts it this long after it began.
    pub cancel_after: Option<Duration>,
    /// No fault or abort touches it, so liveness applies: it must be delivered, ready at the
    /// proxy and read back by every decoder (or, when `oversized`, refused at once).
    pub fault_free: bool,
    /// It declares more chunks than the receiver's buffer.
    pub oversized: bool,
}

impl RequestPlan {
    pub fn new(id: &str, prefill: usize, decode: usize, chunks: u32, batch_chunks: u32) -> Self {
        Self {
            id: id.to_owned(),
            start_at: Duration::from_millis(20),
            prefill,
            decode,
            chunks,
            declared: chunks,
            batch_chunks,
            cancel_after: None,
            fault_free: true,
            oversized: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// One TCP reset of every control connection between the two nodes.
    Disconnect { a: String, b: String },
    Partition {
        a: String,
        b: String,
        lasts: Duration,
    },
    /// The node dies (its memory and connections with it) and restarts after `lasts`.
    Crash { node: String, lasts: Duration },
    /// The process hangs (its NIC and the network do not).
    Pause { node: String, lasts: Duration },
    /// Extra latency on writes between the two nodes, and on control messages too unless
    /// `fabric_only`.
    Slow {
        a: String,
        b: String,
        extra: Duration,
        lasts: Duration,
        fabric_only: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct FaultEvent {
    pub at: Duration,
    pub fault: Fault,
}

/// Latency, bandwidth and reconnection of the simulated network.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkModel {
    /// One-way latency of a control message: uniform in this range (the spread is jitter;
    /// each connection stays FIFO). madsim's timers sleep at least 1 ms, so latencies below
    /// that are rounded up; the model works at millisecond scale.
    pub control_latency_min: Duration,
    pub control_latency_max: Duration,
    /// One-way latency of a one-sided write, and of its acknowledgement.
    pub fabric_latency: Duration,
    /// Each node's NIC sends this many bytes per second, shared by its connections.
    pub egress_bytes_per_sec: u64,
    /// A write in flight this long errors its connection (verbs: the retry count is
    /// exhausted), flushing everything outstanding. This is what bounds a write whose
    /// sender hangs (it cannot reset the connection then): keep it at or below the
    /// senders' `write_timeout`, which the receivers' quarantine is sized against.
    pub qp_retry_timeout: Duration,
    /// A broken control connection is retried after this, doubling up to the max.
    pub reconnect_backoff_min: Duration,
    pub reconnect_backoff_max: Duration,
}

impl Default for LinkModel {
    fn default() -> Self {
        Self {
            control_latency_min: Duration::from_millis(1),
            control_latency_max: Duration::from_micros(1_500),
            fabric_latency: Duration::from_millis(1),
            egress_bytes_per_sec: 10_000_000_000,
            qp_retry_timeout: Duration::from_secs(1),
            reconnect_backoff_min: Duration::from_millis(20),
            reconnect_backoff_max: Duration::from_millis(500),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub seed: u64,
    pub tp: usize,
    pub prefill: Vec<PrefillWorker>,
    pub decode: Vec<DecodeWorker>,
    pub proxy: ProxyConfig,
    pub chunk_bytes: usize,
    pub prefill_chunk_time: Duration,
    pub decode_delay: Duration,
    pub decoder_consumes: bool,
    /// Decoders lease each ready request as it comes through `ReadyLeases` (Python's
    /// intake), instead of hearing notices and leasing at the verdict (`decoder.rs`).
    pub decoder_takes_leases: bool,
    pub model: LinkModel,
    pub requests: Vec<RequestPlan>,
    pub faults: Vec<FaultEvent>,
    /// Every fault has ended by now (partitions healed, crashed nodes restarted).
    pub heal_at: Duration,
}

impl SimConfig {
    /// `prefill` × `decode` workers of one rank each, every buffer `buffer_slots` and every
    /// staging pool `staging_slots`, the simulation's timeouts, no requests yet.
    pub fn new(prefill: usize, decode: usize, buffer_slots: u32, staging_slots: u32) -> Self {
        let sender = SenderConfig {
            staging_slots,
            admission_reply_timeout: Duration::from_secs(7),
            reply_timeout: Duration::from_millis(1_500),
            write_timeout: Duration::from_secs(1),
            staging_timeout: Duration::from_secs(8),
            notify_proxy_on_failure: true,
            ..SenderConfig::default()
        };
        let receiver = ReceiverConfig {
            buffer_slots,
            admission_timeout: Duration::from_secs(5),
            request_idle_timeout: Duration::from_secs(2),
            // Below the idle lease, so that the stall rule (a reservation that lands nothing
            // while another principal waits is taken back) is live in every run: G4 then shows
            // it never fails a request whose chunks land at the fabric's pace.
            stall_timeout: Duration::from_secs(1),
            // Longer than the proxy's kv_ready_timeout: a rank that finished first keeps its
            // KV until the proxy has decided.
            unconsumed_ttl: Duration::from_secs(15),
            write_quarantine: Duration::from_secs(5),
            tombstone_ttl: Duration::from_secs(60),
            // One sender may use the whole buffer unless a test says otherwise (the swarm
            // draws shares: `plan::random`).
            peer_share_percent: 100,
            ..ReceiverConfig::default()
        };
        let proxy = ProxyConfig {
            kv_ready_timeout: Duration::from_secs(12),
            ..ProxyConfig::default()
        };
        let worker = PrefillWorker {
            sender,
            interleave: 1,
            allocate_first: false,
        };
        Self {
            seed: 0,
            tp: 1,
            prefill: vec![worker; prefill],
            decode: vec![DecodeWorker { receiver }; decode],
            proxy,
            chunk_bytes: 256,
            prefill_chunk_time: Duration::ZERO,
            decode_delay: Duration::from_millis(1),
            decoder_consumes: true,
            decoder_takes_leases: false,
            model: LinkModel::default(),
            requests: Vec::new(),
            faults: Vec::new(),
            heal_at: Duration::ZERO,
        }
    }

    pub fn with(mut self, plan: RequestPlan) -> Self {
        self.requests.push(plan);
        self
    }

    /// How long leftovers of the fault phase may live: receivers' leases, quarantines and
    /// unconsumed TTLs, senders' reply timeouts (a message handed to a broken connection is
    /// lost, and only its timeout tells), and the reconnect backoff. Requests that must be
    /// delivered start this long after healing.
    pub fn settle(&self) -> Duration {
        let receivers = self.decode.iter().map(|d| {
            let r = &d.receiver;
            r.request_idle_timeout
                .max(r.write_quarantine)
                .max(r.unconsumed_ttl)
        });
        let senders = self.prefill.iter().map(|p| {
            let s = &p.sender;
            s.admission_reply_timeout
                .max(s.reply_timeout)
                .max(s.write_timeout)
        });
        let longest = receivers.chain(senders).max().unwrap_or_default();
        longest + self.model.reconnect_backoff_max * 2 + Duration::from_millis(500)
    }

    /// The most a request may take from its start to its end everywhere, faults or not.
    pub fn request_bound(&self) -> Duration {
        let sender = self
            .prefill
            .iter()
            .map(|p| p.sender.admission_reply_timeout + p.sender.staging_timeout)
            .max()
            .unwrap_or_default();
        self.proxy.kv_ready_timeout.max(sender) + Duration::from_secs(10)
    }

    /// Every sender-receiver pair passes `ReceiverConfig::check_sender`: the simulation tests
    /// the protocol under the deployments kvx accepts.
    pub fn check(&self) -> Result<(), String> {
        for d in &self.decode {
            for p in &self.prefill {
                d.receiver
                    .check_sender(&p.sender)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    pub fn receiver_of(&self, plan: &RequestPlan, rank: usize) -> String {
        receiver_node(plan.decode, rank)
    }
}
