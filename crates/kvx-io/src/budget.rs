//! `ConnectionBudget`: how many connections a listener holds, and which one goes when a new
//! one arrives past the cap. Every listener kvx opens to peers (the ZMQ sockets, the HTTP
//! `--metrics` server) takes each accepted connection through one, so that idle connections
//! can never lock a legitimate peer out: the listener never refuses a newcomer for lack of
//! room, it closes the quietest connection instead.
//!
//! The quietest is the one that has gone longest without being heard (a message, a request):
//! one never heard from at all goes first, the oldest of those first, so a flood of sockets
//! that connect and wait loses to a peer that talks. A cap per source address keeps one
//! address from taking the whole table, so that evictions fall on its own connections first.
//!
//! A connection's task runs its work through `Held::run`, which ends it when it is evicted;
//! dropping the `Held` (its task ended) gives its place back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::Notify;

/// A listener's connections and its caps.
#[derive(Debug, Clone)]
pub struct ConnectionBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    total_max: usize,
    per_source_max: usize,
    started: Instant,
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    next: u64,
    held: BTreeMap<u64, Entry>,
}

#[derive(Debug)]
struct Entry {
    from: IpAddr,
    heard: Arc<AtomicU64>,
    evicted: Arc<Notify>,
}

/// One held connection's place; give it back by dropping it.
#[derive(Debug)]
pub struct Held {
    id: u64,
    budget: Arc<Inner>,
    heard: Arc<AtomicU64>,
    evicted: Arc<Notify>,
}

/// What `ConnectionBudget::open` did to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted(pub usize);

impl ConnectionBudget {
    /// At most `total_max` connections, `per_source_max` from one address (both at least 1).
    pub fn new(total_max: usize, per_source_max: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                total_max: total_max.max(1),
                per_source_max: per_source_max.clamp(1, total_max.max(1)),
                started: Instant::now(),
                table: Mutex::new(Table::default()),
            }),
        }
    }

    /// Takes a place for a connection from `from`, first closing the quietest connection
    /// from there past the per-source cap, then the quietest of all past the total cap.
    pub fn open(&self, from: IpAddr) -> (Held, Evicted) {
        let inner = &self.inner;
        let mut table = lock(&inner.table);
        let mut evicted = 0;
        if table.held.values().filter(|e| e.from == from).count() >= inner.per_source_max {
            evicted += usize::from(table.evict(Some(from)));
        }
        if table.held.len() >= inner.total_max {
            evicted += usize::from(table.evict(None));
        }
        table.next += 1;
        let id = table.next;
        let (heard, notify) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
        table.held.insert(
            id,
            Entry {
                from,
                heard: heard.clone(),
                evicted: notify.clone(),
            },
        );
        let held = Held {
            id,
            budget: inner.clone(),
            heard,
            evicted: notify,
        };
        (held, Evicted(evicted))
    }

    /// Connections held now.
    pub fn len(&self) -> usize {
        lock(&self.inner.table).held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Table {
    /// Closes the quietest connection (from `from`, if given). False when there is none.
    fn evict(&mut self, from: Option<IpAddr>) -> bool {
        let quietest = self
            .held
            .iter()
            .filter(|(_, e)| from.is_none_or(|f| e.from == f))
            .min_by_key(|(id, e)| (e.heard.load(Ordering::Relaxed), **id))
            .map(|(id, _)| *id);
        match quietest.and_then(|id| self.held.remove(&id)) {
            Some(entry) => {
                // A stored permit: the connection ends even if its task is not waiting yet.
                entry.evicted.notify_one();
                true
            }
            None => false,
        }
    }
}

impl Held {
    /// The connection was heard from: it moves to the back of the eviction order.
    pub fn heard(&self) {
        let since = self.budget.started.elapsed().as_millis() as u64;
        self.heard.store(since + 1, Ordering::Relaxed);
    }

    /// Runs `work` until it ends or this connection is evicted; `None` when evicted.
    pub async fn run<T>(&self, work: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            () = self.evicted.notified() => None,
            out = work => Some(out),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.budget.table).held.remove(&self.id);
    }
}

fn lock(m: &Mutex<Table>) -> MutexGuard<'_, Table> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[tokio::test]
    async fn past_a_cap_the_quietest_goes_never_heard_first() {
        let budget = ConnectionBudget::new(3, 3);
        let (talker, _) = budget.open(ip(1));
        talker.heard();
        let (silent_old, _) = budget.open(ip(2));
        let (silent_new, _) = budget.open(ip(2));
        let (newcomer, evicted) = budget.open(ip(3));
        assert_eq!(evicted, Evicted(1));
        assert_eq!(budget.len(), 3);
        // The oldest silent one was told to go; the talker and the newer silent one stay.
        assert_eq!(silent_old.run(std::future::pending::<()>()).await, None);
        let still = |h: &Held| futures_now(h.run(async { 1 })) == Some(Some(1));
        assert!(still(&talker) && still(&silent_new) && still(&newcomer));
        drop(silent_old);
        assert_eq!(budget.len(), 3, "an evicted place is not counted twice");
    }

    #[tokio::test]
    async fn one_address_is_held_to_its_own_cap() {
        let budget = ConnectionBudget::new(10, 2);
        let (other, _) = budget.open(ip(9));
        let (a, _) = budget.open(ip(1));
        let (b, _) = budget.open(ip(1));
        let (_c, evicted) = budget.open(ip(1));
        assert_eq!(evicted, Evicted(1));
        assert_eq!(
            a.run(std::future::pending::<()>()).await,
            None,
            "its own oldest goes"
        );
        assert_eq!(futures_now(b.run(async { 2 })), Some(Some(2)));
        assert_eq!(
            futures_now(other.run(async { 3 })),
            Some(Some(3)),
            "others keep theirs"
        );
        drop(a);
        drop(b);
        assert_eq!(budget.len(), 2);
    }

    /// Polls `f` once: its output if it is ready at once.
    fn futures_now<F: std::future::Future>(f: F) -> Option<F::Output> {
        let mut f = std::pin::pin!(f);
        let waker = std::task::Waker::noop();
        match f.as_mut().poll(&mut std::task::Context::from_waker(waker)) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }
}
