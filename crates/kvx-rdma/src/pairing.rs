//! A receiver connection's pairing of each write's receive completion with the `WriteFrame`
//! its sender sent ahead of it on the side channel, without IO (`docs/spec/fabrics.md` §5b).
//!
//! The two arrive on different paths — the frame over TCP, the completion from the NIC — so
//! either may come first; both come in the sender's posting order (TCP keeps its bytes in
//! order; an RC queue pair consumes receives in the order its peer posted the writes). So:
//! - a completion pairs with the first queued frame of its immediate; frames queued before
//!   that one are of writes that never landed here (a post that failed, a write flushed by a
//!   fence), and are dropped;
//! - a completion with no frame yet waits, oldest first; a frame that comes for the oldest
//!   waiting completion pairs with it, any other frame then is of a write that never landed
//!   and is dropped;
//! - a completion waits at most a bound (`overdue`): then it is announced as carrying no
//!   checksum, so that a receiver that requires checksums fails its request at once instead
//!   of letting it time out, and one that does not takes it as it takes any write without
//!   one. Its frame, should it still come, is recognised and dropped (`given_up`).
//!
//! Memory is bounded by what the peer may have in flight, `in_flight_max`: the receives the
//! connection keeps posted (a landed write holds one until its completion is taken here) plus
//! the receiver's slots (a posted write not yet landed fills a slot granted to its sender).
//! More frames ahead of their completions is a broken or hostile peer, and ends the
//! connection; more completions waiting for their frames gives the oldest up at once, as if
//! overdue (a sender that sends frames first has none waiting but for a moment).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::wire::WriteFrame;

/// A write with immediate that landed, as its receive completion told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recv {
    pub imm: u32,
    pub byte_len: u32,
}

#[derive(Debug)]
pub(crate) struct Pairing {
    /// Frames read whose completion has not come, in posting order.
    frames: VecDeque<WriteFrame>,
    /// Completions whose frame has not come, oldest first, with when each came.
    waiting: VecDeque<(Recv, Instant)>,
    /// Immediates of completions announced without their frame (`overdue`), oldest first:
    /// their frames, should they come, are dropped.
    given_up: VecDeque<u32>,
    in_flight_max: usize,
}

impl Pairing {
    /// At most `in_flight_max` frames ahead of their completions, as many completions
    /// waiting for theirs, and as many given up.
    pub(crate) fn new(in_flight_max: usize) -> Self {
        Pairing {
            frames: VecDeque::new(),
            waiting: VecDeque::new(),
            given_up: VecDeque::new(),
            in_flight_max: in_flight_max.max(1),
        }
    }

    /// A frame came. Returns the completion it pairs with, if one waited for it; an error
    /// when the peer sent more frames ahead than it can have writes in flight.
    pub(crate) fn frame(&mut self, f: WriteFrame) -> Result<Option<(Recv, WriteFrame)>, String> {
        if self.given_up.front() == Some(&f.imm) {
            // The frame of a completion already announced without it: the next to come, as
            // frames come in posting order (only the front is compared, since a slot's
            // immediate comes back with its next grant of the same generation).
            self.given_up.pop_front();
            return Ok(None);
        }
        if let Some((head, _)) = self.waiting.front() {
            if head.imm == f.imm {
                let (recv, _) = self.waiting.pop_front().expect("a head");
                return Ok(Some((recv, f)));
            }
            // A completion waits, so every frame of a write posted before it has come: this
            // one is of a write that never landed (or its sender skipped the waiting one's).
            return Ok(None);
        }
        if self.frames.len() >= self.in_flight_max {
            return Err(format!(
                "{} write frames ahead of their writes: more than the sender can have in flight",
                self.frames.len() + 1
            ));
        }
        self.frames.push_back(f);
        Ok(None)
    }

    /// A completion came at `now`. Returns it with its frame, if the frame came first.
    pub(crate) fn completion(&mut self, r: Recv, now: Instant) -> Option<(Recv, WriteFrame)> {
        if self.waiting.is_empty() {
            if let Some(at) = self.frames.iter().position(|f| f.imm == r.imm) {
                // Frames before it are of writes posted before it that never landed.
                let f = self.frames.drain(..=at).next_back().expect("at least one");
                return Some((r, f));
            }
        }
        // Its frame has not come: every queued frame is of a write posted before it that
        // never landed here.
        self.frames.clear();
        self.waiting.push_back((r, now));
        None
    }

    /// When the oldest waiting completion is overdue, `bound` after it came.
    pub(crate) fn deadline(&self, bound: Duration) -> Option<Instant> {
        self.waiting.front().map(|(_, since)| *since + bound)
    }

    /// The oldest waiting completion, if it has waited `bound` at `now` (or more wait than
    /// the peer can have in flight): it goes without its frame from now on.
    pub(crate) fn overdue(&mut self, now: Instant, bound: Duration) -> Option<Recv> {
        let (_, since) = self.waiting.front()?;
        if now < *since + bound && self.waiting.len() <= self.in_flight_max {
            return None;
        }
        let (recv, _) = self.waiting.pop_front()?;
        self.give_up(recv.imm);
        Some(recv)
    }

    /// Every waiting completion, given up (the connection ends: no more frames are read).
    pub(crate) fn take_waiting(&mut self) -> Vec<Recv> {
        let left: Vec<Recv> = self.waiting.drain(..).map(|(r, _)| r).collect();
        for r in &left {
            self.give_up(r.imm);
        }
        left
    }

    fn give_up(&mut self, imm: u32) {
        if self.given_up.len() >= self.in_flight_max {
            self.given_up.pop_front();
        }
        self.given_up.push_back(imm);
    }

    /// Frames and completions held (a test's view of the bound).
    #[cfg(test)]
    pub(crate) fn held(&self) -> (usize, usize, usize) {
        (self.frames.len(), self.waiting.len(), self.given_up.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(5);

    fn frame(imm: u32) -> WriteFrame {
        WriteFrame {
            imm,
            len: 100 + imm,
            checksum: Some(imm * 3),
        }
    }

    fn recv(imm: u32) -> Recv {
        Recv {
            imm,
            byte_len: 100 + imm,
        }
    }

    #[test]
    fn frames_first_or_completions_first_pair_the_same() {
        let now = Instant::now();
        let mut p = Pairing::new(8);
        // Frame first.
        assert_eq!(p.frame(frame(1)), Ok(None));
        assert_eq!(p.completion(recv(1), now), Some((recv(1), frame(1))));
        // Completion first.
        assert_eq!(p.completion(recv(2), now), None);
        assert_eq!(p.completion(recv(3), now), None);
        assert_eq!(p.frame(frame(2)), Ok(Some((recv(2), frame(2)))));
        assert_eq!(p.frame(frame(3)), Ok(Some((recv(3), frame(3)))));
        // Mixed: one frame ahead, one completion behind.
        assert_eq!(p.frame(frame(4)), Ok(None));
        assert_eq!(p.frame(frame(5)), Ok(None));
        assert_eq!(p.completion(recv(4), now), Some((recv(4), frame(4))));
        assert_eq!(p.completion(recv(5), now), Some((recv(5), frame(5))));
        assert_eq!(p.held(), (0, 0, 0));
    }

    #[test]
    fn frames_of_writes_that_never_landed_are_dropped() {
        let now = Instant::now();
        let mut p = Pairing::new(8);
        // Write 1 failed before landing; write 2 landed.
        p.frame(frame(1)).expect("room");
        p.frame(frame(2)).expect("room");
        assert_eq!(p.completion(recv(2), now), Some((recv(2), frame(2))));
        assert_eq!(p.held(), (0, 0, 0));
        // A completion waits; a frame of an earlier write that never landed comes late.
        p.frame(frame(3)).expect("room");
        assert_eq!(p.completion(recv(5), now), None);
        assert_eq!(p.held(), (0, 1, 0), "frame 3's write never landed");
        assert_eq!(p.frame(frame(4)), Ok(None), "not the waiting one's");
        assert_eq!(p.frame(frame(5)), Ok(Some((recv(5), frame(5)))));
    }

    #[test]
    fn a_completion_whose_frame_never_comes_goes_without_it_after_the_bound() {
        let t0 = Instant::now();
        let mut p = Pairing::new(8);
        assert_eq!(p.completion(recv(1), t0), None);
        assert_eq!(p.completion(recv(2), t0 + BOUND / 2), None);
        assert_eq!(p.deadline(BOUND), Some(t0 + BOUND));
        assert_eq!(p.overdue(t0 + BOUND / 2, BOUND), None);
        assert_eq!(p.overdue(t0 + BOUND, BOUND), Some(recv(1)));
        assert_eq!(p.overdue(t0 + BOUND, BOUND), None, "the next one waits on");
        // Frame 1 comes late: dropped, and frame 2 still pairs.
        assert_eq!(p.frame(frame(1)), Ok(None));
        assert_eq!(p.frame(frame(2)), Ok(Some((recv(2), frame(2)))));
        assert_eq!(p.held(), (0, 0, 0));
        // At the connection's end whatever waits is given up too.
        assert_eq!(p.completion(recv(3), t0), None);
        assert_eq!(p.take_waiting(), vec![recv(3)]);
        assert_eq!(p.held(), (0, 0, 1));
    }

    #[test]
    fn memory_is_bounded_by_what_the_peer_may_have_in_flight() {
        let t0 = Instant::now();
        let mut p = Pairing::new(4);
        for imm in 0..4 {
            assert_eq!(p.frame(frame(imm)), Ok(None));
        }
        assert!(
            p.frame(frame(4)).is_err(),
            "a fifth frame ahead of its write"
        );
        // More completions waiting than can be in flight: the oldest go at once.
        let mut p = Pairing::new(4);
        for imm in 0..6 {
            p.completion(recv(imm), t0);
        }
        assert_eq!(p.overdue(t0, BOUND), Some(recv(0)));
        assert_eq!(p.overdue(t0, BOUND), Some(recv(1)));
        assert_eq!(p.overdue(t0, BOUND), None);
        // Given-up completions are remembered at most as many.
        while p.overdue(t0 + BOUND, BOUND).is_some() {}
        for imm in 10..20 {
            p.completion(recv(imm), t0);
        }
        while p.overdue(t0 + BOUND, BOUND).is_some() {}
        assert_eq!(p.held(), (0, 0, 4));
    }
}
