//! Returned reservations (caller placement) for every caller of one receiver: the driver's
//! channel of returns, and the returns a caller took but handed back unseen (an awaitable
//! cancelled after its Rust future had taken them), which the next call gets first. So a
//! return, which tells the application its slots are its own again, is never lost to a
//! caller that went away.

use std::collections::VecDeque;
use std::sync::Mutex;

use kvx_node::{Returned, Returns};
use tokio::sync::Notify;

/// The returns of one receiver, handed out in the order they came back (those given back
/// first: they are the older).
pub(crate) struct ReturnQueue {
    /// The driver's channel; one caller reads it at a time.
    channel: tokio::sync::Mutex<Returns>,
    /// Returns handed back unseen.
    given_back: Mutex<VecDeque<Returned>>,
    /// Wakes a caller waiting on the channel when returns are handed back.
    handed_back: Notify,
}

impl ReturnQueue {
    pub(crate) fn new(channel: Returns) -> Self {
        Self {
            channel: tokio::sync::Mutex::new(channel),
            given_back: Mutex::new(VecDeque::new()),
            handed_back: Notify::new(),
        }
    }

    /// Up to `max` returns, once the first is there; `None` once the driver has stopped
    /// and every return was taken. Cancel-safe: a dropped call takes nothing.
    pub(crate) async fn take(&self, max: usize) -> Option<Vec<Returned>> {
        if max == 0 {
            return Some(Vec::new());
        }
        let mut channel = self.channel.lock().await;
        let mut out = Vec::new();
        loop {
            self.take_given_back(max, &mut out);
            if !out.is_empty() {
                break;
            }
            tokio::select! {
                got = channel.recv() => match got {
                    Some(first) => {
                        out.push(first);
                        break;
                    }
                    // The driver stopped: what was handed back meanwhile is still due.
                    None => {
                        self.take_given_back(max, &mut out);
                        return (!out.is_empty()).then_some(out);
                    }
                },
                () = self.handed_back.notified() => {}
            }
        }
        while out.len() < max {
            match channel.try_recv() {
                Ok(next) => out.push(next),
                Err(_) => break,
            }
        }
        Some(out)
    }

    /// Hands `returns` back unseen: the next `take` gets them first, in the same order.
    pub(crate) fn give_back(&self, returns: Vec<Returned>) {
        if returns.is_empty() {
            return;
        }
        let mut given = self.given_back.lock().unwrap_or_else(|p| p.into_inner());
        for r in returns.into_iter().rev() {
            given.push_front(r);
        }
        drop(given);
        self.handed_back.notify_one();
    }

    fn take_given_back(&self, max: usize, out: &mut Vec<Returned>) {
        let mut given = self.given_back.lock().unwrap_or_else(|p| p.into_inner());
        while out.len() < max {
            match given.pop_front() {
                Some(r) => out.push(r),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kvx_proto::receiver::Outcome;
    use kvx_proto::{ReqId, SlotIndex};
    use tokio::sync::mpsc;

    use super::*;

    fn back(id: &str) -> Returned {
        Returned {
            req_id: ReqId(id.into()),
            slots: vec![SlotIndex(0)],
            outcome: Outcome::Consumed,
        }
    }

    fn ids(got: &[Returned]) -> Vec<&str> {
        got.iter().map(|r| r.req_id.0.as_str()).collect()
    }

    #[tokio::test]
    async fn returns_handed_back_come_first_and_in_their_order() {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = ReturnQueue::new(rx);
        for id in ["a", "b", "c"] {
            tx.send(back(id)).expect("the queue is alive");
        }
        let taken = queue.take(2).await.expect("returns are due");
        assert_eq!(ids(&taken), ["a", "b"]);
        queue.give_back(taken);
        assert_eq!(
            ids(&queue.take(8).await.expect("returns are due")),
            ["a", "b", "c"]
        );
    }

    #[tokio::test]
    async fn a_waiting_take_hears_returns_handed_back() {
        let (_tx, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(ReturnQueue::new(rx));
        let waiting = tokio::spawn({
            let queue = queue.clone();
            async move { queue.take(8).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        queue.give_back(vec![back("a")]);
        let got = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiting take was woken")
            .expect("the take did not panic")
            .expect("returns are due");
        assert_eq!(ids(&got), ["a"]);
    }

    #[tokio::test]
    async fn after_the_driver_stopped_returns_handed_back_are_still_due() {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = ReturnQueue::new(rx);
        tx.send(back("a")).expect("the queue is alive");
        drop(tx);
        let taken = queue.take(8).await.expect("returns are due");
        queue.give_back(taken);
        assert_eq!(ids(&queue.take(8).await.expect("returns are due")), ["a"]);
        assert!(queue.take(8).await.is_none(), "stopped, and nothing left");
        assert_eq!(queue.take(0).await.map(|v| v.len()), Some(0));
    }
}
