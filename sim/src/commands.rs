//! What the router and the run hand to the application on a node, and the channels it goes
//! through: a prefill engine's commands (a dispatched job and the channels
//! the router follows it on, a cancel, a staging query), a decoder's (the proxy's verdict,
//! consume, a snapshot of its buffer), and each node's channel by name (`Mailboxes`, kept in
//! the `World`: opened when a node starts its engine or decoder, gone when it crashes).

use std::collections::BTreeMap;

use kvx_node::BufferSnapshot;
use tokio::sync::{mpsc, oneshot};

/// One rank's share of a request, as the router hands it to a prefill engine.
#[derive(Debug, Clone)]
pub struct Job {
    pub req_id: String,
    pub rank: usize,
    pub decode: usize,
    pub chunks: u32,
    pub declared: u32,
    pub batch_chunks: u32,
}

/// A job and the channels the router follows it on.
#[derive(Debug)]
pub struct Dispatch {
    pub job: Job,
    /// Admitted (Ok) or failed before admission (Err).
    pub admitted: oneshot::Sender<Result<(), String>>,
    /// Transfer now; dropped unsent: abort the request.
    pub go: oneshot::Receiver<()>,
    /// Delivered (Ok) or failed (Err), as the sender reports it.
    pub done: oneshot::Sender<Result<(), String>>,
}

#[derive(Debug)]
pub enum EngineCmd {
    Prefill(Box<Dispatch>),
    Cancel(String),
    /// (free, capacity) of the staging pool.
    Staging(oneshot::Sender<(u32, u32)>),
}

#[derive(Debug)]
pub enum DecoderCmd {
    /// The proxy's word on a request: ready (read and verify it) or failed (discard it).
    Verdict {
        req_id: String,
        ready: bool,
        chunks: u32,
    },
    Consume(String),
    Snapshot(oneshot::Sender<BufferSnapshot>),
}

/// Each node's command channel, by node name.
#[derive(Debug, Default)]
pub struct Mailboxes {
    engines: BTreeMap<String, mpsc::UnboundedSender<EngineCmd>>,
    decoders: BTreeMap<String, mpsc::UnboundedSender<DecoderCmd>>,
}

impl Mailboxes {
    /// `node` serves as a prefill engine on `tx` (replacing a previous incarnation's).
    pub fn open_engine(&mut self, node: &str, tx: mpsc::UnboundedSender<EngineCmd>) {
        self.engines.insert(node.to_owned(), tx);
    }

    /// `node` serves as a decoder on `tx` (replacing a previous incarnation's).
    pub fn open_decoder(&mut self, node: &str, tx: mpsc::UnboundedSender<DecoderCmd>) {
        self.decoders.insert(node.to_owned(), tx);
    }

    /// `node` crashed: nothing reaches its application until it starts again.
    pub fn close(&mut self, node: &str) {
        self.engines.remove(node);
        self.decoders.remove(node);
    }

    pub fn engine(&self, node: &str) -> Option<mpsc::UnboundedSender<EngineCmd>> {
        self.engines.get(node).cloned()
    }

    pub fn decoder(&self, node: &str) -> Option<mpsc::UnboundedSender<DecoderCmd>> {
        self.decoders.get(node).cloned()
    }
}
