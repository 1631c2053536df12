//! How a receiver-side request ends, and the reason a sender is given for each refusal.
//! Every reason names the request and says what a person can do about it.

use std::fmt;

use crate::admission::Refusal;

/// Why the receiver refused or ended a request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// `req_id` was empty: LMCache's legacy path, which has no admission control.
    NoReqId,
    /// `total_chunks == 0` on the first batch.
    ZeroChunks,
    /// The request declares more chunks than the whole buffer holds.
    LargerThanBuffer {
        /// The request's `total_chunks`.
        need: u32,
        /// The buffer's slots.
        capacity: u32,
    },
    /// Too many requests wait for admission.
    AdmissionQueueFull {
        /// `admission_queue_max`.
        max: usize,
    },
    /// This sender already has too many requests waiting.
    PeerQueueFull {
        /// `peer_queue_max`.
        max: usize,
    },
    /// Too many requests are tracked.
    TooManyRequests {
        /// `requests_max`.
        max: usize,
    },
    /// Waited `admission_timeout` without a reservation.
    AdmissionTimeout,
    /// The sender broke the protocol (the text says how); the request is rolled back.
    ProtocolViolation(String),
    /// The sender cancelled the request.
    Cancelled,
    /// No batch and no landed chunk for `request_idle_timeout`: the sender is presumed dead.
    IdleTimeout,
    /// The sender's control connection closed before the request was complete
    /// (`ReceiverLedger::handle_peer_lost`): its process ended or its connection broke, and
    /// a kvx sender fails its requests on its side when that happens.
    SenderLost,
    /// Complete but not consumed by the decoder within `unconsumed_ttl`.
    Unconsumed,
    /// The request already ended; a late batch is refused, never admitted afresh.
    AlreadyEnded(Box<Outcome>),
    /// A chunk landed empty or failed its checksum: the decoder must never read it.
    Integrity(String),
    /// The sender sends no `seq` (LMCache's own), and this receiver refuses such senders.
    LegacySender,
    /// A field of the request is larger than this receiver accepts (the text says which).
    TooLarge(String),
    /// Caller placement: the application withdrew the request's reservation (it aborted
    /// the request on its side).
    Withdrawn,
    /// Caller placement: no sender claimed the reservation within `admission_timeout`.
    Unclaimed,
    /// Caller placement: another sender connection already claimed this request id; a
    /// reservation is claimed once.
    AlreadyClaimed,
    /// Nothing of the request landed for `stall_timeout` while another principal waited for
    /// the buffer: its reservation was taken back (`docs/spec/protocol.md` §Stalls).
    Stalled {
        /// The stall time (`stall_timeout`).
        after: std::time::Duration,
    },
    /// Caller placement: the first batch does not carry the reservation's claim secret
    /// (`crate::claim`), so it is not from the sender the reservation was made for. The
    /// reservation is not touched: its own sender may still claim it.
    ClaimNotProven {
        /// Whether the batch carried a secret at all (a wrong one), or none.
        secret_sent: bool,
    },
    /// Caller placement: a first batch came before its reservation, and its sender's
    /// principal (or all senders together) already waits for as many reservations as the
    /// bound allows.
    TooManyWaitingClaims {
        /// The bound: the principal's share of slots, or the buffer's slots.
        max: u32,
        /// Which bound.
        whose: &'static str,
    },
    /// A batch declares a chunk longer than the receiver's slots (`chunk_bytes`): no write
    /// of it could ever land, so the request fails before it writes (the two ends were
    /// started with different chunk sizes; under the vLLM connector, block sizes).
    ChunkSizeMismatch {
        /// The sender's chunk, in bytes.
        chunk: u64,
        /// The receiver's slot, in bytes.
        slot: u64,
    },
    /// Caller placement: the request declares more chunks than its reservation has slots.
    LargerThanReservation {
        /// The request's `total_chunks`.
        need: u32,
        /// The reservation's slots.
        reserved: u32,
    },
}

/// The end of a request on the receiver: exactly one per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The decoder read it (`handle_consume`).
    Consumed,
    /// Refused, or rolled back before the decoder consumed it.
    Failed(Failure),
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::ZeroChunks => Failure::ZeroChunks,
            Refusal::LargerThanBuffer { need, capacity } => {
                Failure::LargerThanBuffer { need, capacity }
            }
            Refusal::QueueFull { max } => Failure::AdmissionQueueFull { max },
            Refusal::PeerQueueFull { max } => Failure::PeerQueueFull { max },
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NoReqId => f.write_str(
                "no req_id: kvx does not serve LMCache's legacy path; send req_id and total_chunks",
            ),
            Failure::ZeroChunks => f.write_str(
                "total_chunks is 0 on the first batch: declare how many chunks the request will send",
            ),
            Failure::LargerThanBuffer { need, capacity } => write!(
                f,
                "request needs {need} chunks but the receiver buffer has only {capacity} slots: \
                 raise the receiver's buffer size or lower the prompt length"
            ),
            Failure::PeerQueueFull { max } => write!(
                f,
                "this sender already has {max} requests waiting for admission (peer_queue_max): \
                 retry later"
            ),
            Failure::AdmissionQueueFull { max } => {
                write!(f, "admission queue is full ({max} requests wait): retry later or add receivers")
            }
            Failure::TooManyWaitingClaims { max, whose } => write!(
                f,
                "{max} first batches already wait for reservations the decode side has not made \
                 ({whose}): claim a request once it is reserved, or retry later"
            ),
            Failure::TooManyRequests { max } => {
                write!(f, "receiver tracks {max} requests already: retry later or raise requests_max")
            }
            Failure::AdmissionTimeout => f.write_str(
                "admission timed out: the buffer stayed full for admission_timeout; \
                 the decoder may not be consuming requests",
            ),
            Failure::ProtocolViolation(why) => write!(f, "protocol violation: {why}; the request was rolled back"),
            Failure::Cancelled => f.write_str("cancelled by the sender"),
            Failure::IdleTimeout => f.write_str(
                "no batch or write arrived for request_idle_timeout: the sender is presumed dead \
                 and the reservation was reclaimed",
            ),
            Failure::Unconsumed => f.write_str("the decoder did not consume the request within unconsumed_ttl"),
            Failure::AlreadyEnded(outcome) => write!(f, "request already ended ({outcome}); late batch refused"),
            Failure::Integrity(why) => write!(f, "chunk integrity: {why}; the request was rolled back"),
            Failure::TooLarge(why) => write!(f, "too large: {why}"),
            Failure::Withdrawn => f.write_str(
                "the decoding application withdrew the request's reservation (it aborted the request)",
            ),
            Failure::Unclaimed => f.write_str(
                "no sender claimed the reservation within admission_timeout: the prefill side \
                 never sent the request, or sent it elsewhere",
            ),
            Failure::ClaimNotProven { secret_sent: false } => f.write_str(
                "the request carries no claim secret: this receiver's reservations are claimed \
                 only with the secret the application handed to the sender it chose (the \
                 request id alone claims nothing)",
            ),
            Failure::ClaimNotProven { secret_sent: true } => f.write_str(
                "the request's claim secret is not its reservation's: only the sender the \
                 reservation was made for can claim it",
            ),
            Failure::Stalled { after } => write!(
                f,
                "no chunk of this request landed for {after:?} (stall_timeout) while another \
                 sender waited for the buffer: its reservation was taken back; land chunks \
                 as they are computed, or raise the receiver's stall_timeout"
            ),
            Failure::SenderLost => f.write_str(
                "the sender's control connection closed before the request was complete (its \
                 process ended, or the connection broke): it fails the request on its side too; \
                 retry it",
            ),
            Failure::AlreadyClaimed => f.write_str(
                "another sender connection already claimed this request id: a reservation is \
                 claimed once (a restarted or duplicate prefill cannot write into it)",
            ),
            // Worded as the fabrics' own refusal (`kvx_io::fabric::slot_size_mismatch`), which
            // the vLLM connector translates into both engines' block sizes.
            Failure::ChunkSizeMismatch { chunk, slot } => write!(
                f,
                "the sender's chunks are {chunk} bytes but the receiver's slots are {slot} bytes: \
                 start both with the same chunk size"
            ),
            Failure::LargerThanReservation { need, reserved } => write!(
                f,
                "request needs {need} chunks but its reservation lends {reserved} slots: the \
                 prefill and decode sides disagree on the request's size"
            ),
            Failure::LegacySender => f.write_str(
                "this receiver takes kvx senders only: a sender without seq writes its KV on a \
                 channel the receiver cannot see, so nothing would say when the bytes are in; \
                 start the receiver with legacy_senders = \"after-proxy\" if the application \
                 marks requests ready when the proxy reports them",
            ),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Consumed => f.write_str("consumed"),
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Failure, Outcome};

    /// An outcome reads as what happened, a failure with its reason (the drivers log it so).
    #[test]
    fn an_outcome_reads_as_what_happened() {
        assert_eq!(Outcome::Consumed.to_string(), "consumed");
        let failed = Outcome::Failed(Failure::ZeroChunks).to_string();
        assert_eq!(failed, format!("failed: {}", Failure::ZeroChunks));
        assert!(failed.contains("total_chunks is 0"), "{failed}");
    }
}
