//! `ConnectionBudget`: how many connections a listener holds, and which one goes when a new
//! one arrives past the cap. Every listener kvx opens to peers (the ZMQ sockets, the fabric
//! listeners and the shm handoff socket, the HTTP `--metrics` server) takes each accepted
//! connection through one, so that idle connections can never lock a legitimate peer out: the
//! listener never refuses a newcomer for lack of room, it closes the quietest connection
//! instead.
//!
//! The quietest is chosen by standing first, then by how long it has gone without being heard
//! (a message, a request, a write that landed): a connection never heard from at all goes
//! first (the oldest of those first), then one heard from but not authenticated, then an
//! authenticated one (`Held::authenticated`: a fabric connection whose hello carried a valid
//! credential). So a flood of sockets that connect and wait, or that greet without a
//! credential, loses to a peer that authenticated, and among peers that did, an idle one goes
//! before one that is writing. A newcomer never closes an authenticated connection itself:
//! when only those are left it is taken beyond the cap while it greets (`open`), and its own
//! authentication closes one of them: its own source's quietest, else the quietest of the
//! source holding the most, so authenticated idlers from a few addresses close each other and
//! never a lone sender's idle connection. A cap per source keeps one address (or, for a Unix socket, one
//! user) from taking the whole table, so that evictions fall on its own connections first.
//!
//! A connection's task runs its work through `Held::run`, which ends it when it is evicted;
//! dropping the `Held` (its task ended) gives its place back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::Notify;

/// A listener's connections and its caps; `K` is what the per-source cap counts by (the peer's
/// address for TCP listeners).
#[derive(Debug, Clone)]
pub struct ConnectionBudget<K = IpAddr> {
    inner: Arc<Inner<K>>,
}

#[derive(Debug)]
struct Inner<K> {
    total_max: usize,
    per_source_max: usize,
    started: Instant,
    table: Mutex<Table<K>>,
}

#[derive(Debug)]
struct Table<K> {
    next: u64,
    held: BTreeMap<u64, Entry<K>>,
}

#[derive(Debug)]
struct Entry<K> {
    from: K,
    mark: Arc<Mark>,
    evicted: Arc<Notify>,
}

/// How a connection stands: what it has shown, and when it was last heard.
#[derive(Debug, Default)]
struct Mark {
    /// `NEVER_HEARD`, `HEARD` or `AUTHENTICATED`; it only rises.
    standing: AtomicU8,
    /// Microseconds since the budget began, plus one, when last heard; 0 never.
    heard: AtomicU64,
}

const HEARD: u8 = 1;
const AUTHENTICATED: u8 = 2;

impl Mark {
    /// The eviction order: lowest first.
    fn key(&self) -> (u8, u64) {
        (
            self.standing.load(Ordering::Relaxed),
            self.heard.load(Ordering::Relaxed),
        )
    }
}

/// One held connection's place; give it back by dropping it.
#[derive(Debug)]
pub struct Held<K = IpAddr> {
    id: u64,
    budget: Arc<Inner<K>>,
    mark: Arc<Mark>,
    evicted: Arc<Notify>,
}

/// What `ConnectionBudget::open` did to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted(pub usize);

impl<K: Copy + Eq> ConnectionBudget<K> {
    /// At most `total_max` connections, `per_source_max` from one source (both at least 1).
    pub fn new(total_max: usize, per_source_max: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                total_max: total_max.max(1),
                per_source_max: per_source_max.clamp(1, total_max.max(1)),
                started: Instant::now(),
                table: Mutex::new(Table {
                    next: 0,
                    held: BTreeMap::new(),
                }),
            }),
        }
    }

    /// Takes a place for a connection from `from`, first closing, past the per-source cap, the
    /// quietest connection from there, then, past the total cap, the quietest of all; but a
    /// newcomer never closes an authenticated connection. Where only authenticated ones are
    /// left to close, it is taken beyond the cap while it greets (with at most a quarter of
    /// `total_max` others, `pending_max`; past that the oldest of them goes), and it is its own
    /// authentication that closes an authenticated connection (`Held::authenticated`): its own
    /// source's quietest, else the quietest of the source holding the most.
    /// A listener whose connections never authenticate keeps exactly `total_max`.
    pub fn open(&self, from: K) -> (Held<K>, Evicted) {
        let inner = &self.inner;
        let mut table = lock(&inner.table);
        let mut evicted = 0;
        if table.held.values().filter(|e| e.from == from).count() >= inner.per_source_max {
            evicted += usize::from(table.evict(Some(from), UNAUTHENTICATED));
        }
        let unauthenticated = table.unauthenticated();
        let authenticated = table.held.len() - unauthenticated;
        let room = inner
            .total_max
            .saturating_sub(authenticated)
            .max(inner.pending_max());
        if unauthenticated >= room {
            evicted += usize::from(table.evict(None, UNAUTHENTICATED));
        }
        table.next += 1;
        let id = table.next;
        let (mark, notify) = (Arc::new(Mark::default()), Arc::new(Notify::new()));
        table.held.insert(
            id,
            Entry {
                from,
                mark: mark.clone(),
                evicted: notify.clone(),
            },
        );
        let held = Held {
            id,
            budget: inner.clone(),
            mark,
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

impl<K> Inner<K> {
    /// Newcomers taken beyond `total_max` while they greet, when every connection it holds
    /// is authenticated.
    fn pending_max(&self) -> usize {
        (self.total_max / 4).max(1)
    }
}

/// Which connections `Table::evict` may close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Among {
    /// Connections that have not authenticated.
    Unauthenticated,
    /// Authenticated connections other than this one.
    AuthenticatedBut(u64),
}

const UNAUTHENTICATED: Among = Among::Unauthenticated;

impl Among {
    /// Whether connection `id` is one of these.
    fn takes<K>(self, id: u64, e: &Entry<K>) -> bool {
        let authenticated = e.mark.standing.load(Ordering::Relaxed) >= AUTHENTICATED;
        match self {
            Among::Unauthenticated => !authenticated,
            Among::AuthenticatedBut(this) => authenticated && id != this,
        }
    }
}

impl<K: Copy + Eq> Table<K> {
    /// Connections not authenticated.
    fn unauthenticated(&self) -> usize {
        self.held
            .values()
            .filter(|e| e.mark.standing.load(Ordering::Relaxed) < AUTHENTICATED)
            .count()
    }

    /// The source with the most connections of `among`, the one whose quietest connection
    /// is quietest among equals.
    fn busiest_source(&self, among: Among) -> Option<K> {
        // (source, its connections, its quietest's eviction order: lowest goes first)
        type Quietest = ((u8, u64), u64);
        let mut counts: Vec<(K, usize, Quietest)> = Vec::new();
        for (id, e) in self.held.iter().filter(|(id, e)| among.takes(**id, e)) {
            let quiet = (e.mark.key(), *id);
            match counts.iter_mut().find(|(from, _, _)| *from == e.from) {
                Some((_, n, quietest)) => {
                    *n += 1;
                    *quietest = (*quietest).min(quiet);
                }
                None => counts.push((e.from, 1, quiet)),
            }
        }
        counts
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)))
            .map(|(from, _, _)| from)
    }

    /// Closes the quietest connection of `among` (from `from`, if given). False when there is
    /// none.
    fn evict(&mut self, from: Option<K>, among: Among) -> bool {
        let quietest = self
            .held
            .iter()
            .filter(|(_, e)| from.is_none_or(|f| e.from == f))
            .filter(|(id, e)| among.takes(**id, e))
            .min_by_key(|(id, e)| (e.mark.key(), **id))
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

impl<K> Held<K> {
    /// The connection was heard from: it moves behind every connection of its standing heard
    /// from less recently, and behind every one never heard from.
    pub fn heard(&self) {
        self.mark.standing.fetch_max(HEARD, Ordering::Relaxed);
        self.stamp();
    }

    fn stamp(&self) {
        let since = self.budget.started.elapsed().as_micros() as u64;
        self.mark.heard.store(since + 1, Ordering::Relaxed);
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

impl<K: Copy + Eq> Held<K> {
    /// The connection authenticated (and was heard from): from now on no newcomer closes it,
    /// and it goes only for another authenticated connection, by how recently each was heard.
    /// If that takes its source's authenticated connections past the per-source cap, its
    /// source's quietest other is closed now; if it takes all of them past the total cap, its
    /// own source's quietest other, or, where its source holds no other, the quietest of the
    /// source holding the most (counted in the answer). So authenticated idlers from a few
    /// addresses close each other, never a lone sender's idle connection.
    pub fn authenticated(&self) -> Evicted {
        self.mark
            .standing
            .fetch_max(AUTHENTICATED, Ordering::Relaxed);
        self.stamp();
        let inner = &self.budget;
        let mut table = lock(&inner.table);
        let Some(from) = table.held.get(&self.id).map(|e| e.from) else {
            return Evicted(0); // already closed for a newcomer
        };
        let others = Among::AuthenticatedBut(self.id);
        let mut evicted = 0;
        let authenticated_from = |table: &Table<K>| {
            table
                .held
                .values()
                .filter(|e| e.from == from)
                .filter(|e| e.mark.standing.load(Ordering::Relaxed) >= AUTHENTICATED)
                .count()
        };
        if authenticated_from(&table) > inner.per_source_max {
            evicted += usize::from(table.evict(Some(from), others));
        }
        if table.held.len() - table.unauthenticated() > inner.total_max {
            // Its own source's quietest first; else the quietest of the source that holds the
            // most authenticated connections: a flood's, never a lone sender's first.
            let closed = table.evict(Some(from), others)
                || table
                    .busiest_source(others)
                    .is_some_and(|busiest| table.evict(Some(busiest), others));
            evicted += usize::from(closed);
        }
        Evicted(evicted)
    }
}

impl<K> Drop for Held<K> {
    fn drop(&mut self) {
        lock(&self.budget.table).held.remove(&self.id);
    }
}

fn lock<K>(m: &Mutex<Table<K>>) -> MutexGuard<'_, Table<K>> {
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

    /// Never heard goes before heard-but-unauthenticated, which goes before authenticated,
    /// however recently each was heard; among the authenticated, the one heard longest ago.
    #[tokio::test]
    async fn standing_comes_before_quietness() {
        let pause = || tokio::time::sleep(std::time::Duration::from_millis(5));
        let budget = ConnectionBudget::new(4, 4);
        let (writer, _) = budget.open(ip(1));
        writer.authenticated();
        let (idle_authenticated, _) = budget.open(ip(2));
        idle_authenticated.authenticated();
        let (greeted, _) = budget.open(ip(3));
        let (silent, _) = budget.open(ip(4));
        pause().await;
        greeted.heard();
        writer.heard(); // a write landed: still authenticated, heard last
        let gone = |h: &Held| futures_now(h.run(std::future::pending::<()>())) == Some(None);
        let (n1, _) = budget.open(ip(9));
        assert!(gone(&silent) && !gone(&greeted), "never heard goes first");
        let (n2, _) = budget.open(ip(9));
        assert!(
            gone(&n1) && !gone(&greeted),
            "a silent newcomer before the greeted one"
        );
        n2.authenticated();
        let (n3, _) = budget.open(ip(9));
        assert!(
            gone(&greeted) && !gone(&idle_authenticated),
            "then the unauthenticated"
        );
        pause().await;
        n3.authenticated();
        // Only authenticated ones are left: a newcomer is taken beyond the cap while it
        // greets, and its authentication closes its own address's authenticated one heard
        // longest ago (not the other addresses' idle one).
        let (n4, evicted) = budget.open(ip(9));
        assert_eq!((evicted, budget.len()), (Evicted(0), 5));
        assert_eq!(n4.authenticated(), Evicted(1));
        assert!(
            gone(&n2) && !gone(&idle_authenticated) && !gone(&writer),
            "then its own address's authenticated one heard longest ago"
        );
        // From an address holding no other, the authenticated one heard longest ago of the
        // address holding the most (127.0.0.9: two).
        let (n7, _) = budget.open(ip(8));
        assert_eq!(n7.authenticated(), Evicted(1));
        assert!(
            gone(&n3) && !gone(&idle_authenticated) && !gone(&writer),
            "then the busiest address's"
        );
        // Newcomers that do not authenticate close one another, never the writer.
        let (n5, _) = budget.open(ip(9));
        let (_n6, evicted) = budget.open(ip(9));
        assert_eq!(evicted, Evicted(1));
        assert!(
            gone(&n5) && !gone(&writer),
            "idle newcomers never close the writer"
        );
        assert_eq!(budget.len(), 5);
    }

    /// Every place authenticated and idlers reconnecting all the time: a sender greeting
    /// amid them is not closed by the next newcomer (up to a quarter of the cap greet beyond
    /// it), and once it authenticates it closes the idler heard from longest ago.
    #[tokio::test]
    async fn a_greeting_sender_outlasts_reconnecting_idlers() {
        let budget = ConnectionBudget::new(8, 8);
        let idlers: Vec<_> = (0..8)
            .map(|i| {
                let (h, _) = budget.open(ip(10 + i));
                h.authenticated();
                h
            })
            .collect();
        let gone = |h: &Held| futures_now(h.run(std::future::pending::<()>())) == Some(None);
        let (sender, evicted) = budget.open(ip(1));
        assert_eq!(evicted, Evicted(0), "taken beyond the cap while it greets");
        let (reconnecting, evicted) = budget.open(ip(20));
        assert_eq!(evicted, Evicted(0));
        assert!(
            !gone(&sender),
            "another newcomer does not close a greeting sender"
        );
        assert_eq!(sender.authenticated(), Evicted(1));
        assert!(gone(&idlers[0]) && !gone(&sender));
        assert_eq!(reconnecting.authenticated(), Evicted(1));
        assert!(gone(&idlers[1]) && !gone(&sender));
        assert_eq!(budget.len(), 8);
    }

    /// The per-source cap counts by any key: a Unix listener counts by user.
    #[test]
    fn sources_may_be_any_key() {
        let budget: ConnectionBudget<u32> = ConnectionBudget::new(8, 1);
        let (_a, _) = budget.open(1000);
        let (_b, evicted) = budget.open(1000);
        assert_eq!(evicted, Evicted(1));
        let (_c, evicted) = budget.open(1001);
        assert_eq!((evicted, budget.len()), (Evicted(0), 2));
    }

    /// Polls `f` once: its output if it is ready at once.
    /// Authenticated idlers from a few addresses, past the total cap, close each other (the
    /// newcomer's own address's first, else the busiest address's), never a lone sender's
    /// idle connection, however long it has been quiet.
    #[tokio::test]
    async fn authenticated_idlers_close_each_other_not_a_lone_sender() {
        let budget = ConnectionBudget::new(4, 4);
        let (sender, _) = budget.open(ip(1));
        let _ = sender.authenticated();
        std::thread::sleep(std::time::Duration::from_millis(2)); // it is the quietest
        let mut idlers = Vec::new();
        for from in [2, 2, 3] {
            let (h, _) = budget.open(ip(from));
            assert_eq!(h.authenticated(), Evicted(0));
            idlers.push(h);
        }
        let gone = |h: &Held| futures_now(h.run(std::future::pending::<()>())) == Some(None);
        // From an address with others: one of its own goes.
        let (own, _) = budget.open(ip(3));
        assert_eq!(own.authenticated(), Evicted(1));
        assert!(gone(&idlers[2]) && !gone(&sender), "its own address's");
        // From a new address: the busiest address (127.0.0.2, two) loses its quietest.
        let (fresh, _) = budget.open(ip(4));
        assert_eq!(fresh.authenticated(), Evicted(1));
        assert!(gone(&idlers[0]) && !gone(&sender), "the busiest address's");
        assert_eq!(
            futures_now(sender.run(async { 1 })),
            Some(Some(1)),
            "the lone sender keeps its connection"
        );
    }

    fn futures_now<F: std::future::Future>(f: F) -> Option<F::Output> {
        let mut f = std::pin::pin!(f);
        let waker = std::task::Waker::noop();
        match f.as_mut().poll(&mut std::task::Context::from_waker(waker)) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }
}
