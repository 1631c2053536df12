//! What a harness run does: which requests, from which sender to which receiver, how big,
//! when they start, and the faults to inject.

use std::time::Duration;

use crate::config::{ProxyConfig, ReceiverConfig, SenderConfig};

/// One request of the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPlan {
    /// Index of the sender in `ClusterSpec::senders`.
    pub sender: usize,
    /// Index of the receiver in `ClusterSpec::receivers`.
    pub receiver: usize,
    /// The request's id; unique within the plan.
    pub req_id: String,
    /// Chunks the request really has.
    pub chunks: u32,
    /// Chunks it declares (normally `chunks`); larger than the buffer for the oversized case.
    pub declared: u32,
    /// Chunks per submitted batch (the last may be smaller).
    pub batch_chunks: u32,
    /// When the prefill engine may start it (it also waits for an `interleave` slot).
    pub start_after: Duration,
    /// Cancel it this long after it began, if it has not ended.
    pub cancel_after: Option<Duration>,
    /// Fail the write of this chunk (a fabric error).
    pub fail_write_of_chunk: Option<u32>,
    /// This request's writes take this long instead of `Timing::write_time`.
    pub write_time: Option<Duration>,
}

impl RequestPlan {
    /// `chunks` chunks in batches of `batch_chunks`, from `sender` to `receiver`, declared
    /// as they are, started at once, with no fault.
    pub fn new(
        sender: usize,
        receiver: usize,
        req_id: impl Into<String>,
        chunks: u32,
        batch_chunks: u32,
    ) -> Self {
        Self {
            sender,
            receiver,
            req_id: req_id.into(),
            chunks,
            declared: chunks,
            batch_chunks,
            start_after: Duration::ZERO,
            cancel_after: None,
            fail_write_of_chunk: None,
            write_time: None,
        }
    }
}

/// Timing of the simulated world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timing {
    /// One-way latency of a control message.
    pub net_latency: Duration,
    /// Extra random delay per message, at most this (per-link FIFO is kept).
    pub jitter: Duration,
    /// Time one chunk's write occupies its (sender, receiver) connection.
    pub write_time: Duration,
    /// Time the prefill engine takes to produce one chunk.
    pub prefill_chunk_time: Duration,
    /// Time from "ready" to the decoder consuming a request.
    pub decode_delay: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            net_latency: Duration::from_micros(50),
            jitter: Duration::ZERO,
            write_time: Duration::from_micros(100),
            prefill_chunk_time: Duration::from_micros(20),
            decode_delay: Duration::from_millis(1),
        }
    }
}

/// The whole harness setup.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// One configuration per sender; a sender's index is its `PeerId`.
    pub senders: Vec<SenderConfig>,
    /// One configuration per receiver; a receiver's index is its `PeerId`.
    pub receivers: Vec<ReceiverConfig>,
    /// The proxy's configuration.
    pub proxy: ProxyConfig,
    /// Requests each sender's prefill engine works on at once.
    pub interleave: usize,
    /// Latencies and durations of the simulated world.
    pub timing: Timing,
    /// The workload.
    pub requests: Vec<RequestPlan>,
    /// Seed of the jitter.
    pub seed: u64,
    /// Senders that die (stop everything) this long after the start.
    pub kill_sender_after: Vec<(usize, Duration)>,
    /// Whether the decoder consumes ready requests (off: the unconsumed-TTL case).
    pub decoder_consumes: bool,
}

impl ClusterSpec {
    /// `senders` senders and `receivers` receivers with the given buffer and staging sizes,
    /// failure notices to the proxy on, no requests yet.
    pub fn new(senders: usize, receivers: usize, buffer_slots: u32, staging_slots: u32) -> Self {
        let sender = SenderConfig {
            staging_slots,
            notify_proxy_on_failure: true,
            ..SenderConfig::default()
        };
        // One sender may use the whole buffer (the scenarios size requests against it);
        // `with_peer_share` sets a share.
        let receiver = ReceiverConfig {
            buffer_slots,
            peer_share_percent: 100,
            ..ReceiverConfig::default()
        };
        Self {
            senders: vec![sender; senders],
            receivers: vec![receiver; receivers],
            proxy: ProxyConfig::default(),
            interleave: 1,
            timing: Timing::default(),
            requests: Vec::new(),
            seed: 0,
            kill_sender_after: Vec::new(),
            decoder_consumes: true,
        }
    }

    /// Adds `plan` to the workload.
    pub fn with(mut self, plan: RequestPlan) -> Self {
        self.requests.push(plan);
        self
    }

    /// Every receiver lets one sender hold at most `percent` of its buffer.
    pub fn with_peer_share(mut self, percent: u32) -> Self {
        for r in &mut self.receivers {
            r.peer_share_percent = percent;
        }
        self
    }
}
