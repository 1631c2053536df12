//! The one cancel-safe hand-over of what must reach a caller or go back: ready requests as
//! leases (`lease::ReadyLeases`), returned reservations, request ends and admissions. Each
//! is taken by callers on many tasks or threads, any of which may stop waiting at any point
//! (a timeout, a cancelled task, an asyncio await cancelled after its Rust future was done),
//! and none may be lost to it: a read lease lost is a request never decoded, a returned
//! reservation lost is slots the application never gets back.
//!
//! Three pieces, each written once:
//! - `GivenBack`: items a caller took but could not pass on, handed out again first; a
//!   waiting caller hears of them.
//! - `Handover`: a result on its way from a task to the caller that awaits it; dropped
//!   before it arrives, it gives the items back.
//! - `SharedStream`: a driver's channel for many callers, with `GivenBack` in front of it.
//!
//! The Python package's awaitables end in the same place: what they carry across the event
//! loop goes back through the `give_back` of the stream it came from.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::{mpsc, oneshot, Notify};

/// Items taken for callers that could not pass them on, for the next caller, oldest first.
#[derive(Debug)]
pub struct GivenBack<T> {
    items: Mutex<VecDeque<T>>,
    /// Wakes the callers waiting for a stream when items are given back.
    arrived: Notify,
}

impl<T> Default for GivenBack<T> {
    fn default() -> Self {
        Self {
            items: Mutex::new(VecDeque::new()),
            arrived: Notify::new(),
        }
    }
}

impl<T> GivenBack<T> {
    /// Gives `items` back, after those given back before them; the callers waiting now hear
    /// of it (`wait`).
    pub fn give_back(&self, items: Vec<T>) {
        if items.is_empty() {
            return;
        }
        self.lock().extend(items);
        self.arrived.notify_waiters();
    }

    /// Up to `max` items given back, oldest first.
    pub fn take(&self, max: usize) -> Vec<T> {
        let mut items = self.lock();
        let n = items.len().min(max);
        items.drain(..n).collect()
    }

    /// Runs `wait` (a cancel-safe wait for the stream behind these items) until it ends or
    /// items are given back: `Ok` with up to `max` of those, else `Err` with what `wait`
    /// gave. Looks before it waits, and hears items given back while it looks. Cancel-safe
    /// when `wait` is.
    pub async fn or_wait<F: Future>(&self, max: usize, wait: F) -> Result<Vec<T>, F::Output> {
        tokio::pin!(wait);
        loop {
            // Armed before the look, so that items given back after it end the wait.
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let given = self.take(max);
            if !given.is_empty() {
                return Ok(given);
            }
            tokio::select! {
                got = &mut wait => return Err(got),
                () = &mut arrived => {}
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<T>> {
        self.items.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A result on its way from the task that made it to the caller awaiting it
/// (`handover`). Dropped before it arrives (the caller stopped waiting), it closes the way
/// and gives back the items that had arrived; the task gives back any it sends later
/// (`Handing::send`).
#[derive(Debug)]
pub struct Handover<T, E> {
    taken: oneshot::Receiver<Result<Vec<T>, E>>,
    back: Arc<GivenBack<T>>,
}

/// The task's side of a `Handover`.
#[derive(Debug)]
pub struct Handing<T, E> {
    tx: oneshot::Sender<Result<Vec<T>, E>>,
    back: Arc<GivenBack<T>>,
}

/// A hand-over of items that go back to `back` when its caller is gone.
pub fn handover<T, E>(back: Arc<GivenBack<T>>) -> (Handing<T, E>, Handover<T, E>) {
    let (tx, taken) = oneshot::channel();
    (
        Handing {
            tx,
            back: back.clone(),
        },
        Handover { taken, back },
    )
}

impl<T, E> Handing<T, E> {
    /// Resolves once the caller stopped waiting: the task may stop a wait that takes
    /// nothing yet.
    pub async fn closed(&mut self) {
        self.tx.closed().await;
    }

    /// Hands `result` over, or gives its items back if the caller is gone.
    pub fn send(self, result: Result<Vec<T>, E>) {
        if let Err(Ok(items)) = self.tx.send(result) {
            self.back.give_back(items);
        }
    }
}

impl<T, E> Future for Handover<T, E> {
    type Output = Result<Vec<T>, E>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // An error: the task panicked; whatever it held was dropped (a lease released) as
        // it unwound.
        Pin::new(&mut self.taken)
            .poll(cx)
            .map(|got| got.unwrap_or_else(|_| Ok(Vec::new())))
    }
}

impl<T, E> Drop for Handover<T, E> {
    fn drop(&mut self) {
        self.taken.close();
        if let Ok(Ok(items)) = self.taken.try_recv() {
            self.back.give_back(items);
        }
    }
}

/// A driver's channel for callers on many tasks or threads, with the items callers gave
/// back in front of it.
#[derive(Debug)]
pub struct SharedStream<T> {
    /// One caller reads it at a time.
    stream: tokio::sync::Mutex<mpsc::UnboundedReceiver<T>>,
    given_back: GivenBack<T>,
}

impl<T> SharedStream<T> {
    /// `stream`, shared.
    pub fn new(stream: mpsc::UnboundedReceiver<T>) -> Self {
        Self {
            stream: tokio::sync::Mutex::new(stream),
            given_back: GivenBack::default(),
        }
    }

    /// Up to `max` items once the first is there, those given back first; `None` once the
    /// channel has closed and every item was taken. Cancel-safe: a dropped call takes
    /// nothing.
    pub async fn take(&self, max: usize) -> Option<Vec<T>> {
        if max == 0 {
            return Some(Vec::new());
        }
        let mut stream = self.stream.lock().await;
        let mut out = match self.given_back.or_wait(max, stream.recv()).await {
            Ok(given) => given,
            Err(Some(first)) => vec![first],
            // Closed: what was given back meanwhile is still due.
            Err(None) => {
                let given = self.given_back.take(max);
                return (!given.is_empty()).then_some(given);
            }
        };
        while out.len() < max {
            match stream.try_recv() {
                Ok(next) => out.push(next),
                Err(_) => break,
            }
        }
        Some(out)
    }

    /// Gives `items` back unseen: the next `take` gets them first, in the same order.
    pub fn give_back(&self, items: Vec<T>) {
        self.given_back.give_back(items);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn items_given_back_come_first_and_in_their_order() {
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = SharedStream::new(rx);
        for id in ["a", "b", "c"] {
            tx.send(id).expect("the stream is alive");
        }
        let taken = stream.take(2).await.expect("items are due");
        assert_eq!(taken, ["a", "b"]);
        stream.give_back(taken);
        assert_eq!(
            stream.take(8).await.expect("items are due"),
            ["a", "b", "c"]
        );
    }

    #[tokio::test]
    async fn a_waiting_take_hears_items_given_back() {
        let (_tx, rx) = mpsc::unbounded_channel::<&str>();
        let stream = Arc::new(SharedStream::new(rx));
        let waiting = tokio::spawn({
            let stream = stream.clone();
            async move { stream.take(8).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        stream.give_back(vec!["a"]);
        let got = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiting take was woken")
            .expect("the take did not panic")
            .expect("items are due");
        assert_eq!(got, ["a"]);
    }

    #[tokio::test]
    async fn after_the_channel_closed_items_given_back_are_still_due() {
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = SharedStream::new(rx);
        tx.send("a").expect("the stream is alive");
        drop(tx);
        let taken = stream.take(8).await.expect("items are due");
        stream.give_back(taken);
        assert_eq!(stream.take(8).await.expect("items are due"), ["a"]);
        assert!(stream.take(8).await.is_none(), "closed, and nothing left");
        assert_eq!(stream.take(0).await.map(|v| v.len()), Some(0));
    }

    #[tokio::test]
    async fn a_take_dropped_while_waiting_takes_nothing() {
        let (tx, rx) = mpsc::unbounded_channel();
        let stream = SharedStream::new(rx);
        let gave_up = tokio::time::timeout(Duration::from_millis(20), stream.take(8)).await;
        assert!(gave_up.is_err(), "nothing came");
        tx.send("a").expect("the stream is alive");
        assert_eq!(stream.take(8).await.expect("items are due"), ["a"]);
    }

    #[tokio::test]
    async fn a_handover_dropped_before_it_arrived_gives_its_items_back() {
        let back = Arc::new(GivenBack::default());
        // Sent, then the caller went away unopened.
        let (handing, on_its_way) = handover::<&str, ()>(back.clone());
        handing.send(Ok(vec!["a"]));
        drop(on_its_way);
        // The caller went away first: the task's late send gives them back.
        let (handing, on_its_way) = handover::<&str, ()>(back.clone());
        drop(on_its_way);
        handing.send(Ok(vec!["b"]));
        assert_eq!(back.take(8), ["a", "b"]);
        // Awaited: the caller gets them.
        let (handing, on_its_way) = handover::<&str, ()>(back.clone());
        handing.send(Ok(vec!["c"]));
        assert_eq!(on_its_way.await, Ok(vec!["c"]));
        assert!(back.take(8).is_empty());
    }
}
