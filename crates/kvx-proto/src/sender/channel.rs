//! One sender's control channel to one receiver: the queue of messages not yet sent, the
//! messages in flight, and how many may be in flight (`docs/spec/protocol.md` §Channel).
//!
//! A kvx receiver echoes `seq`, so the channel is pipelined and one request waiting for
//! admission never holds up another's batches. An LMCache receiver does not: then one
//! message is in flight at a time, and an admission probe is sent only when no other
//! request on the channel is admitted with batches still to send. Sending it earlier is
//! exactly LMCache's head-of-line deadlock (W1): the probe's reply waits for capacity that
//! only the other request's remaining batches can free.

use std::collections::VecDeque;

use crate::ids::{ReqId, StagingSlot};
use crate::time::Instant;
use crate::wire::Message;

/// What the channel has learned of its receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No reply yet: one message in flight until the first reply tells.
    Probing,
    /// The receiver echoes `seq`.
    Pipelined,
    /// The receiver does not echo `seq` (LMCache), or pipelining is off.
    Serial,
}

/// One chunk of a batch: its key, where its bytes are staged, its token count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSpec {
    /// The chunk's cache key, sent in the batch's `keys`.
    pub key: String,
    /// The staging slot holding its bytes (taken with `try_allocate`).
    pub staging: StagingSlot,
    /// Its token count; the last chunk's becomes the batch's `last_chunk_toks`.
    pub tokens: u64,
    /// Its length in bytes, sent in the batch's `chunk_bytes`: the write of the chunk must
    /// bring exactly this many (the receiver refuses any other length). At least 1.
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// An empty first `AllocRequest`: asks for the reservation before any staging is taken.
    Probe,
    Batch {
        chunks: Vec<ChunkSpec>,
        is_last: bool,
    },
    Cancel,
}

#[derive(Debug, Clone)]
pub struct Outgoing {
    pub seq: u64,
    pub req_id: ReqId,
    pub kind: Kind,
    pub msg: Message,
}

#[derive(Debug, Clone)]
pub struct InFlight {
    pub seq: u64,
    pub req_id: ReqId,
    pub kind: Kind,
    pub deadline: Instant,
}

#[derive(Debug, Clone)]
pub struct Channel {
    pub mode: Mode,
    pub queue: VecDeque<Outgoing>,
    pub in_flight: VecDeque<InFlight>,
}

impl Channel {
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            queue: VecDeque::new(),
            in_flight: VecDeque::new(),
        }
    }

    /// How many messages may be in flight at most: `inflight_max` probes plus
    /// `inflight_max` others when pipelined, one when serial.
    pub fn window(&self, inflight_max: usize) -> usize {
        match self.mode {
            Mode::Pipelined => 2 * inflight_max,
            Mode::Probing | Mode::Serial => 1,
        }
    }

    /// Picks the next queued message that may be sent now. `busy_elsewhere(req)` says
    /// whether some *other* admitted request on this channel still has batches to send.
    pub fn next_sendable(
        &mut self,
        inflight_max: usize,
        busy_elsewhere: impl Fn(&ReqId) -> bool,
    ) -> Option<Outgoing> {
        if self.mode == Mode::Pipelined {
            // Probes may wait at the receiver for capacity; batches and cancels never wait,
            // and may be what frees that capacity. So each class has its own window: a
            // window full of waiting probes never holds an admitted request's batches back
            // (found by the simulation: LMCache's W1 again, through the window).
            let probes = self
                .in_flight
                .iter()
                .filter(|f| matches!(f.kind, Kind::Probe))
                .count();
            let others = self.in_flight.len() - probes;
            let pos = self.queue.iter().position(|m| match m.kind {
                Kind::Probe => probes < inflight_max,
                _ => others < inflight_max,
            })?;
            return self.queue.remove(pos);
        }
        if !self.in_flight.is_empty() {
            return None;
        }
        // Serial: a probe may wait at the receiver, and while it waits nothing else can pass
        // on this channel. So batches and cancels (which never wait, and which may be what
        // frees the capacity the probe needs) always go first, and a probe goes only when
        // no other admitted request still needs the channel. A request's own messages keep
        // their order: its batches exist only after its probe was answered, and a request
        // that fails with its probe still queued drops the probe and sends no cancel.
        let pos = match self
            .queue
            .iter()
            .position(|m| !matches!(m.kind, Kind::Probe))
        {
            Some(pos) => pos,
            None => self.queue.iter().position(|m| !busy_elsewhere(&m.req_id))?,
        };
        self.queue.remove(pos)
    }

    /// Matches a reply: by `seq` when the receiver echoes it, else the oldest in flight.
    pub fn take_in_flight(&mut self, seq: Option<u64>) -> Option<InFlight> {
        match seq {
            Some(s) => {
                let pos = self.in_flight.iter().position(|f| f.seq == s)?;
                self.in_flight.remove(pos)
            }
            None if self.mode != Mode::Pipelined => self.in_flight.pop_front(),
            None => None,
        }
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.in_flight.iter().map(|f| f.deadline).min()
    }
}
