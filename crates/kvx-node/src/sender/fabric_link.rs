//! The sender's fabric connections, one per receiver: attaching a new one, posting writes,
//! and replacing a connection that broke or stalled. A write posted while its receiver's
//! connection is being replaced waits for the new one (so a request begun right after a
//! receiver restart does not fail for want of a connection), bounded by the core's write
//! timeout; a reconnect that gives up fails the writes that waited.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvx_io::{Env, Fabric, FabricConn, PostWrite};
use kvx_proto::sender::WriteOp;
use kvx_proto::{PeerId, WriteId};

use super::{Cmd, Driver, Input};

impl<E: Env> Driver<E> {
    pub(super) fn attach_conn(&mut self, peer: PeerId, conn: FabricConn) {
        let (poster, mut completions) = conn.split();
        self.conn_generation += 1;
        let generation = self.conn_generation;
        for write in self.parked.remove(&peer).unwrap_or_default() {
            if poster.post(write).is_err() {
                self.fail_write(write.id, "the new fabric connection closed at once");
            }
        }
        self.conns.insert(peer, (generation, poster));
        self.reconnecting.remove(&peer);
        let inbox = self.inbox_tx.clone();
        self.env.spawn(async move {
            while let Some(c) = completions.recv().await {
                if inbox.send(Input::Done(peer, generation, c)).is_err() {
                    return;
                }
            }
            let _ = inbox.send(Input::ConnGone(peer, generation));
        });
    }

    pub(super) fn replace_if_current(&mut self, peer: PeerId, generation: u64) {
        if self.conns.get(&peer).is_some_and(|(g, _)| *g == generation) {
            self.reset_fabric(peer);
        }
    }

    /// Posts a write the core asked for. With no live connection to its receiver, the write
    /// waits (parked, in order) for the one being made; a write still parked when its
    /// deadline passes is flushed by `flush_parked` (the core's stall), as a reset would flush
    /// it; one whose receiver has no connection coming fails at once.
    pub(super) fn post(&mut self, w: WriteOp) {
        let len = self.shared.lens[w.staging.0 as usize].load(Ordering::Acquire);
        let write = PostWrite {
            id: w.id,
            local: w.staging,
            remote: w.remote,
            len,
            imm: w.tag.map(|t| t.to_imm()),
        };
        let peer = w.receiver;
        if !self.parked.contains_key(&peer) {
            match self.conns.get(&peer).map(|(_, c)| c.post(write)) {
                Some(Ok(())) => return,
                // The connection's task has ended: replace it.
                Some(Err(_)) => self.reset_fabric(peer),
                // None connected: make one (a no-op when one is under way).
                None => self.reset_fabric(peer),
            }
        }
        if self.reconnecting.contains(&peer) {
            self.parked.entry(peer).or_default().push(write);
        } else {
            self.fail_write(write.id, "no fabric connection to the receiver");
        }
    }

    fn fail_write(&self, id: WriteId, why: &str) {
        let now = self.env.now();
        self.shared
            .lock()
            .flow
            .handle_write_done(now, id, Err(why.to_owned()));
    }

    /// Fails every write parked for `peer` (its reconnect gave up, or a parked write became
    /// overdue: nothing may stay parked past the core's write timeout).
    pub(super) fn flush_parked(&mut self, peer: PeerId, why: &str) {
        for write in self.parked.remove(&peer).unwrap_or_default() {
            self.fail_write(write.id, why);
        }
    }

    /// A write is overdue, or the receiver came back after a disconnect: reset the connection
    /// (flushing every outstanding write with an error) and connect afresh in the background.
    pub(super) fn reset_fabric(&mut self, peer: PeerId) {
        if let Some((_, poster)) = self.conns.remove(&peer) {
            tracing::warn!(%peer, "resetting the fabric connection");
            poster.reset();
        }
        if !self.reconnecting.insert(peer) {
            return; // a reconnect is already under way
        }
        let addr = self
            .shared
            .lock()
            .receivers
            .iter()
            .find(|(_, p)| **p == peer)
            .map(|(a, _)| a.clone());
        let Some(addr) = addr else { return };
        let (env, memory, cmd_tx) = (self.env.clone(), self.memory.clone(), self.cmd_tx.clone());
        self.env.spawn(async move {
            // Bounded: about five minutes of attempts, backing off to 5 s between them.
            for attempt in 0..64u32 {
                match env.fabric().connect(&addr.fabric, memory.clone()).await {
                    Ok(conn) => {
                        let _ = cmd_tx.send(Cmd::FabricBack(peer, conn));
                        return;
                    }
                    Err(e) => tracing::warn!(%peer, error = %e, attempt, "fabric reconnect failed"),
                }
                if cmd_tx.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis((100u64 << attempt.min(6)).min(5_000))).await;
            }
            tracing::error!(%peer, "giving up reconnecting the fabric; writes to this receiver fail");
            let _ = cmd_tx.send(Cmd::FabricGaveUp(peer));
        });
    }
}
