//! Completion routing. Every queue pair of a device completes into one completion queue; each
//! work request's `wr_id` names its route (high 32 bits: the connection's key) and its place
//! on that route (low 32 bits: the sender's write sequence, or a receive's number). The poller
//! thread hands each completion to its route's channel; a completion whose route is gone (its
//! connection was dropped) is counted and dropped. A device event that breaks connections
//! (`Device::on_event`) reaches them on the same channel, as `RouteEvent::Broken`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::mpsc;

use crate::verbs::Wc;
use crate::wake::PollerWake;

/// Packs a route key and a sequence number into a `wr_id`.
pub(crate) fn wr_id(key: u32, seq: u32) -> u64 {
    (u64::from(key) << 32) | u64::from(seq)
}

/// Unpacks a `wr_id` into (route key, sequence).
pub(crate) fn split(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32)
}

/// What a connection hears on its route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RouteEvent {
    /// One of its work completions.
    Wc(Wc),
    /// The device broke the connection, and why. `completions_follow`: its queue pair
    /// failed (QP_FATAL and kin) but the completion queue works, so the queue pair's posted
    /// work still completes (flushed, or landed before the error) and can be drained; not
    /// after a completion queue or device failure, whose completions will not come.
    Broken {
        why: String,
        completions_follow: bool,
    },
}

/// The routes of one device.
#[derive(Debug, Default)]
pub(crate) struct Router {
    routes: Mutex<Table>,
    /// Completions that found no route (a dropped connection's late flushes).
    stale: AtomicU64,
    /// The device's poller: woken by every post on a route.
    pub(crate) wake: PollerWake,
}

#[derive(Debug, Default)]
struct Table {
    by_key: HashMap<u32, mpsc::UnboundedSender<RouteEvent>>,
    /// Each route's queue pair, by its number (`Route::bind_qp`).
    by_qpn: HashMap<u32, u32>,
    next_key: u32,
}

impl Router {
    /// A router whose device's poller waits and wakes as `wake` says.
    pub(crate) fn with_wake(wake: PollerWake) -> Self {
        Router {
            routes: Mutex::default(),
            stale: AtomicU64::new(0),
            wake,
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new route; completions with its key arrive on the returned receiver until the `Route`
    /// is dropped. Keys are never 0 and never shared by two live routes.
    pub(crate) fn add(self: &Arc<Self>) -> (Route, mpsc::UnboundedReceiver<RouteEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut t = self.table();
        let key = loop {
            t.next_key = t.next_key.wrapping_add(1);
            let k = t.next_key;
            if k != 0 && !t.by_key.contains_key(&k) {
                break k;
            }
        };
        t.by_key.insert(key, tx);
        let route = Route {
            router: self.clone(),
            key,
        };
        (route, rx)
    }

    /// Hands a batch of completions to their routes.
    pub(crate) fn dispatch(&self, wcs: &[Wc]) {
        let t = self.table();
        for wc in wcs {
            let (key, _) = split(wc.wr_id);
            let delivered = t
                .by_key
                .get(&key)
                .is_some_and(|tx| tx.send(RouteEvent::Wc(*wc)).is_ok());
            if !delivered {
                self.stale.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(wr_id = wc.wr_id, status = ?wc.status, "completion without a route");
            }
        }
    }

    /// Breaks every route (the completion queue or the device failed).
    pub(crate) fn break_all(&self, why: &str) {
        for tx in self.table().by_key.values() {
            let _ = tx.send(RouteEvent::Broken {
                why: why.to_owned(),
                completions_follow: false,
            });
        }
    }

    /// Breaks the route of queue pair `qpn`, if it has one; whether it had.
    pub(crate) fn break_qp(&self, qpn: u32, why: &str) -> bool {
        let t = self.table();
        let Some(tx) = t.by_qpn.get(&qpn).and_then(|key| t.by_key.get(key)) else {
            return false;
        };
        let _ = tx.send(RouteEvent::Broken {
            why: why.to_owned(),
            completions_follow: true,
        });
        true
    }

    #[cfg(test)]
    pub(crate) fn live_routes(&self) -> usize {
        self.table().by_key.len()
    }

    #[cfg(test)]
    pub(crate) fn stale_completions(&self) -> u64 {
        self.stale.load(Ordering::Relaxed)
    }
}

/// A live route; dropping it removes it.
#[derive(Debug)]
pub(crate) struct Route {
    router: Arc<Router>,
    key: u32,
}

impl Route {
    pub(crate) fn key(&self) -> u32 {
        self.key
    }

    pub(crate) fn wr_id(&self, seq: u32) -> u64 {
        wr_id(self.key, seq)
    }

    /// Names the queue pair this route's completions belong to, so that a device event about
    /// it reaches this route (`Router::break_qp`).
    pub(crate) fn bind_qp(&self, qpn: u32) {
        self.router.table().by_qpn.insert(qpn, self.key);
    }

    /// Work was posted on this route's queue pair: the poller looks at once.
    pub(crate) fn posted(&self) {
        self.router.wake.posted();
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        let mut t = self.router.table();
        t.by_key.remove(&self.key);
        let key = self.key;
        t.by_qpn.retain(|_, k| *k != key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{WcKind, WcStatus};

    fn wc(wr_id: u64) -> Wc {
        Wc {
            wr_id,
            status: WcStatus::Success,
            kind: WcKind::Write,
        }
    }

    #[test]
    fn wr_ids_round_trip() {
        assert_eq!(
            split(wr_id(0xDEAD_BEEF, 0xFFFF_FFFF)),
            (0xDEAD_BEEF, 0xFFFF_FFFF)
        );
        assert_eq!(split(wr_id(1, 0)), (1, 0));
    }

    #[test]
    fn completions_reach_their_own_route_only() {
        let router = Arc::new(Router::default());
        let (a, mut ra) = router.add();
        let (b, mut rb) = router.add();
        assert_ne!(a.key(), b.key());
        router.dispatch(&[wc(a.wr_id(1)), wc(b.wr_id(7)), wc(a.wr_id(2))]);
        let seq = |e: RouteEvent| match e {
            RouteEvent::Wc(w) => split(w.wr_id).1,
            RouteEvent::Broken { why, .. } => panic!("broken: {why}"),
        };
        assert_eq!(ra.try_recv().map(seq), Ok(1));
        assert_eq!(ra.try_recv().map(seq), Ok(2));
        assert!(ra.try_recv().is_err());
        assert_eq!(rb.try_recv().map(seq), Ok(7));
        assert_eq!(router.live_routes(), 2);
        drop(a);
        assert_eq!(router.live_routes(), 1);
        router.dispatch(&[wc(wr_id(1, 3))]);
        assert_eq!(
            router.stale_completions(),
            1,
            "a dropped route's completion is stale"
        );
        drop(rb);
        router.dispatch(&[wc(b.wr_id(8))]);
        assert_eq!(router.stale_completions(), 2, "a closed receiver's too");
    }

    #[test]
    fn a_broken_queue_pair_breaks_its_own_route_and_a_broken_device_every_route() {
        let router = Arc::new(Router::default());
        let (a, mut ra) = router.add();
        let (b, mut rb) = router.add();
        a.bind_qp(0x101);
        b.bind_qp(0x102);
        assert!(router.break_qp(0x102, "fatal"));
        assert!(!router.break_qp(0x999, "no such queue pair"));
        assert!(ra.try_recv().is_err());
        assert_eq!(
            rb.try_recv(),
            Ok(RouteEvent::Broken {
                why: "fatal".into(),
                completions_follow: true
            })
        );
        router.break_all("cq error");
        let cq_error = RouteEvent::Broken {
            why: "cq error".into(),
            completions_follow: false,
        };
        assert_eq!(ra.try_recv(), Ok(cq_error.clone()));
        assert_eq!(rb.try_recv(), Ok(cq_error));
        drop(b);
        assert!(!router.break_qp(0x102, "gone with its route"));
    }

    #[test]
    fn keys_skip_zero_and_live_keys_when_wrapping() {
        let router = Arc::new(Router::default());
        let (live, _rx) = router.add();
        assert_eq!(live.key(), 1);
        router.table().next_key = u32::MAX - 1;
        let (a, _ra) = router.add();
        assert_eq!(a.key(), u32::MAX);
        let (b, _rb) = router.add();
        assert_eq!(b.key(), 2, "0 and the live key 1 are skipped");
    }
}
