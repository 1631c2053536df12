//! The transport's tables inside the `World` (bound servers and notice sources, connections
//! and their sessions) and what a break does to them: the session and everything in flight
//! on it are gone, and the client hears.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use kvx_io::{Inbound, Notice};
use kvx_proto::PeerId;
use tokio::sync::{mpsc, watch};

use crate::trace::Trace;

#[derive(Debug)]
pub(crate) struct Server {
    pub(crate) node: String,
    pub(crate) incoming: mpsc::Sender<Inbound>,
    pub(crate) peers: BTreeMap<String, PeerId>,
    pub(crate) routes: BTreeMap<PeerId, u64>,
}

#[derive(Debug)]
pub(crate) struct Source {
    pub(crate) node: String,
    pub(crate) incoming: mpsc::Sender<Notice>,
}

#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) peer: PeerId,
    pub(crate) server_node: String,
    pub(crate) up: mpsc::UnboundedSender<(Duration, Bytes)>,
    pub(crate) down: mpsc::UnboundedSender<(Duration, Bytes)>,
    pub(crate) up_last: Duration,
    pub(crate) down_last: Duration,
}

#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) client: String,
    pub(crate) endpoint: String,
    pub(crate) identity: String,
    /// Bumped on every break; a pipe delivers only while its session's epoch is current.
    pub(crate) epoch: u64,
    pub(crate) session: Option<Session>,
    pub(crate) broken: watch::Sender<u64>,
}

/// The transport's tables, inside the `World`.
#[derive(Debug, Default)]
pub struct NetState {
    pub(crate) servers: BTreeMap<String, Server>,
    pub(crate) sources: BTreeMap<String, Source>,
    pub(crate) links: BTreeMap<u64, Link>,
    pub(crate) next_link: u64,
    /// The number the next notice sink's connection gets (`kvx_io::Notice`).
    pub(crate) next_sink: u64,
}

impl NetState {
    /// Breaks one link: its session (and everything in flight on it) is gone; the client hears.
    fn break_link(&mut self, trace: &mut Trace, now: Duration, link: u64, why: &str) {
        let Some(l) = self.links.get_mut(&link) else {
            return;
        };
        let Some(s) = l.session.take() else { return };
        l.epoch += 1;
        let _ = l.broken.send(l.epoch);
        let (client, endpoint) = (l.client.clone(), l.endpoint.clone());
        if let Some(server) = self.servers.get_mut(&endpoint) {
            if server.routes.get(&s.peer) == Some(&link) {
                server.routes.remove(&s.peer);
                // The server hears that the peer's connection closed, as the ZMQ ROUTER
                // reports it (`Inbound::Lost`); here at once, which is the earliest a real
                // one could (a partition closes a TCP connection only at its timeout).
                let _ = server.incoming.try_send(Inbound::Lost(s.peer));
            }
        }
        trace.record(
            now,
            format_args!("link {client} -> {endpoint} BROKEN ({why})"),
        );
    }

    /// Breaks every control connection between nodes `a` and `b`.
    pub fn break_between(&mut self, trace: &mut Trace, now: Duration, a: &str, b: &str, why: &str) {
        let hit: Vec<u64> = self
            .links
            .iter()
            .filter(|(_, l)| {
                let server = l.session.as_ref().map(|s| s.server_node.as_str());
                server.is_some_and(|s| (l.client == a && s == b) || (l.client == b && s == a))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in hit {
            self.break_link(trace, now, id, why);
        }
    }

    /// `node` crashed: its bound endpoints vanish, connections it served break (their clients
    /// reconnect later), connections it owned are gone.
    pub fn on_crash(&mut self, trace: &mut Trace, now: Duration, node: &str) {
        self.servers.retain(|_, s| s.node != node);
        self.sources.retain(|_, s| s.node != node);
        let hit: Vec<u64> = self
            .links
            .iter()
            .filter(|(_, l)| {
                l.client == node || l.session.as_ref().is_some_and(|s| s.server_node == node)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in hit {
            self.break_link(trace, now, id, "crash");
            if self.links.get(&id).is_some_and(|l| l.client == node) {
                self.links.remove(&id);
            }
        }
    }
}
