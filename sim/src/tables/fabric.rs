//! The fabric's tables inside the `World` (exposed buffers, queue pairs, each node's NIC
//! egress) and what a break does to them: a queue pair in error signals its task, which
//! flushes what is outstanding (`qp`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvx_io::{FabricAccess, LandedWrite};
use kvx_proto::PeerId;
use tokio::sync::{mpsc, watch};

use super::memory::SimMemory;
use crate::trace::Trace;

#[derive(Debug)]
pub(crate) struct Exposed {
    pub(crate) node: String,
    pub(crate) memory: Arc<SimMemory>,
    pub(crate) landed: mpsc::Sender<LandedWrite>,
    pub(crate) access: Arc<FabricAccess>,
}

#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) sender: String,
    pub(crate) receiver: String,
    pub(crate) endpoint: String,
    /// The control peer the connection authenticated as.
    pub(crate) peer: PeerId,
    pub(crate) broken: Option<String>,
    pub(crate) signal: watch::Sender<bool>,
    pub(crate) last_land: Duration,
}

/// The fabric's tables, inside the `World`.
#[derive(Debug, Default)]
pub struct FabricState {
    pub(crate) exposed: BTreeMap<String, Exposed>,
    pub(crate) conns: BTreeMap<u64, Conn>,
    pub(crate) next_conn: u64,
    pub(crate) egress_free: BTreeMap<String, Duration>,
}

impl FabricState {
    /// Puts queue pair `id` in error (once): its task flushes what is outstanding.
    pub(crate) fn break_conn(&mut self, trace: &mut Trace, now: Duration, id: u64, why: &str) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.broken.is_some() {
            return;
        }
        conn.broken = Some(why.to_owned());
        let _ = conn.signal.send(true);
        let (s, e) = (conn.sender.clone(), conn.endpoint.clone());
        trace.record(now, format_args!("qp {id}: {s} -> {e} ERROR ({why})"));
    }

    /// Breaks every queue pair between nodes `a` and `b`.
    pub fn break_between(&mut self, trace: &mut Trace, now: Duration, a: &str, b: &str, why: &str) {
        let hit: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                (c.sender == a && c.receiver == b) || (c.sender == b && c.receiver == a)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in hit {
            self.break_conn(trace, now, id, why);
        }
    }

    /// `node` crashed: its exposed buffers vanish and every queue pair touching it errors.
    pub fn on_crash(&mut self, trace: &mut Trace, now: Duration, node: &str) {
        self.exposed.retain(|_, e| e.node != node);
        let hit: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.sender == node || c.receiver == node)
            .map(|(id, _)| *id)
            .collect();
        for id in hit {
            self.break_conn(trace, now, id, "crash");
        }
    }
}
