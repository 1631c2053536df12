//! The sender's fabric connections, one per receiver: attaching one with the credential the
//! receiver's replies carry, posting writes, and replacing a connection that broke, stalled,
//! or whose credential changed (the receiver restarted). A write posted while its receiver's
//! connection is being made waits for it (so a request's first write does not fail for
//! want of a connection), bounded by the core's write timeout; a connect that gives up fails
//! the writes that waited, with its reason.
//!
//! Writes go in runs: consecutive writes of one request whose staging slots and remote
//! slots both step by one (a run of a layer's KV blocks, contiguous in both engines' memory)
//! are posted as one `WriteRun`, one write where the fabric carries runs (TCP). The core
//! still sees each chunk's write: its own grant, checksum and completion.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvx_io::{
    Env, Fabric, FabricConn, FabricCredential, FabricError, PostWrite, SlotMemory, WriteRun,
};
use kvx_proto::sender::WriteOp;
use kvx_proto::{PeerId, ReqId, WriteId};

use super::{Cmd, Driver, Input};

impl<E: Env> Driver<E> {
    pub(super) fn attach_conn(
        &mut self,
        peer: PeerId,
        conn: FabricConn,
        credential: FabricCredential,
    ) {
        self.connecting.remove(&peer);
        if !self.fabric_attached.insert(peer) {
            metrics::counter!(crate::metrics::SENDER_RECONNECTS, "channel" => "fabric")
                .increment(1);
        }
        let (poster, mut completions) = conn.split();
        self.conn_generation += 1;
        let generation = self.conn_generation;
        let parked = self.parked.remove(&peer).unwrap_or_default();
        for (req_id, run) in self.runs_of(parked) {
            let pieces = run.pieces().to_vec();
            match poster.post_run(run) {
                Ok(writes) => self.count_writes(req_id, writes, &pieces, poster.carries_runs()),
                Err((_, left)) => {
                    for write in left {
                        self.fail_write(write.id, "the new fabric connection closed at once");
                    }
                }
            }
        }
        self.conns.insert(peer, (generation, poster, credential));
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
        // A newer credential arrived while this connection was being made.
        if self
            .credentials
            .get(&peer)
            .is_some_and(|c| *c != credential)
        {
            self.reset_fabric(peer);
        }
    }

    /// A reply carried the receiver's fabric credential: attach with it if no connection
    /// exists yet, or re-attach if the connection uses another (an earlier incarnation's).
    pub(super) fn on_credential(&mut self, peer: PeerId, text: &str) {
        let Some(credential) = FabricCredential::from_text(text) else {
            tracing::warn!(%peer, len = text.len(), "the receiver sent a malformed fabric credential; ignored");
            return;
        };
        if self.credentials.insert(peer, credential) == Some(credential) {
            return;
        }
        match self.conns.get(&peer) {
            Some((_, _, attached)) if *attached == credential => {}
            Some(_) => self.reset_fabric(peer),
            None if self.reconnecting.contains(&peer) => self.start_connect(peer),
            None => {}
        }
    }

    pub(super) fn replace_if_current(&mut self, peer: PeerId, generation: u64) {
        if self
            .conns
            .get(&peer)
            .is_some_and(|(g, _, _)| *g == generation)
        {
            self.reset_fabric(peer);
        }
    }

    /// Posts the writes the core asked for, in order, consecutive ones of a request in runs
    /// (module doc). With no live connection to its receiver, a write waits (parked, in
    /// order) for the one being made; a write still parked when its deadline passes is
    /// flushed by `flush_parked` (the core's stall), as a reset would flush it.
    pub(super) fn post_all(&mut self, writes: Vec<WriteOp>) {
        let mut by_peer: Vec<(PeerId, Vec<(ReqId, PostWrite)>)> = Vec::new();
        for w in writes {
            if let Some(why) = self.refused.get(&w.receiver) {
                self.fail_write(w.id, why);
                continue;
            }
            self.write_posted(w.id);
            let len = self.shared.lens[w.staging.0 as usize].load(Ordering::Acquire);
            let write = PostWrite {
                id: w.id,
                local: w.staging,
                remote: w.remote,
                len,
                imm: w.tag.map(|t| t.to_imm()),
                checksum: self.shared.checksum(w.staging.0),
            };
            if !self.writes_by_req.contains_key(&w.req_id) {
                self.writes_by_req.insert(w.req_id.clone(), 0);
            }
            match by_peer.iter_mut().find(|(p, _)| *p == w.receiver) {
                Some((_, list)) => list.push((w.req_id, write)),
                None => by_peer.push((w.receiver, vec![(w.req_id, write)])),
            }
        }
        for (peer, writes) in by_peer {
            for (req_id, run) in self.runs_of(writes) {
                self.post_run(peer, req_id, run);
            }
        }
    }

    /// `writes` (one receiver's, in posting order) as runs: each run one request's writes
    /// that `WriteRun::continues`.
    fn runs_of(&self, writes: Vec<(ReqId, PostWrite)>) -> Vec<(ReqId, WriteRun)> {
        let slot_bytes = self.memory.slot_bytes();
        let mut runs: Vec<(ReqId, WriteRun)> = Vec::new();
        for (req_id, write) in writes {
            if let Some((last_req, run)) = runs.last_mut() {
                if *last_req == req_id && run.push(write, slot_bytes).is_ok() {
                    continue;
                }
            }
            runs.push((req_id, WriteRun::new(write)));
        }
        runs
    }

    fn post_run(&mut self, peer: PeerId, req_id: ReqId, run: WriteRun) {
        let left = if self.parked.contains_key(&peer) {
            run.into_pieces()
        } else if let Some((_, poster, _)) = self.conns.get(&peer) {
            let (pieces, carries) = (run.pieces().to_vec(), poster.carries_runs());
            match poster.post_run(run) {
                Ok(writes) => {
                    self.count_writes(req_id, writes, &pieces, carries);
                    return;
                }
                // The connection's task has ended: replace it.
                Err((_, left)) => {
                    self.reset_fabric(peer);
                    left
                }
            }
        } else {
            // None connected: make one (a no-op when one is under way).
            self.reset_fabric(peer);
            run.into_pieces()
        };
        let parked = self.parked.entry(peer).or_default();
        parked.extend(left.into_iter().map(|w| (req_id.clone(), w)));
    }

    /// Counts `writes` fabric writes of `req_id` carrying `pieces` (one write of them all
    /// where the connection `carries` runs, else one each).
    fn count_writes(&mut self, req_id: ReqId, writes: usize, pieces: &[PostWrite], carries: bool) {
        let bytes: usize = pieces.iter().map(|w| w.len).sum();
        if carries {
            metrics::histogram!(crate::metrics::SENDER_WRITE_BYTES).record(bytes as f64);
        } else {
            for w in pieces {
                metrics::histogram!(crate::metrics::SENDER_WRITE_BYTES).record(w.len as f64);
            }
        }
        metrics::counter!(crate::metrics::SENDER_FABRIC_WRITES).increment(writes as u64);
        self.shared.count_writes(writes as u64, bytes as u64);
        // Only a request still running has an entry (`post_all` makes it): a parked write
        // of a request that failed meanwhile adds none that nothing would remove.
        if let Some(n) = self.writes_by_req.get_mut(&req_id) {
            *n += writes as u32;
        }
    }

    fn fail_write(&self, id: WriteId, why: &str) {
        let now = self.env.now();
        self.shared
            .lock()
            .flow
            .handle_write_done(now, id, Err(why.to_owned()));
    }

    /// Fails every write parked for `peer` (its connect gave up, or a parked write became
    /// overdue: nothing may stay parked past the core's write timeout).
    pub(super) fn flush_parked(&mut self, peer: PeerId, why: &str) {
        for (_, write) in self.parked.remove(&peer).unwrap_or_default() {
            self.fail_write(write.id, why);
        }
    }

    /// The connection broke, stalled, or its credential is stale: reset it (flushing every
    /// outstanding write with an error) and connect afresh in the background, as soon as a
    /// credential is known.
    pub(super) fn reset_fabric(&mut self, peer: PeerId) {
        if let Some((_, poster, _)) = self.conns.remove(&peer) {
            tracing::warn!(%peer, "resetting the fabric connection");
            poster.reset();
        }
        self.reconnecting.insert(peer);
        self.start_connect(peer);
    }

    /// Starts connecting to `peer`'s fabric unless an attempt is under way or no credential
    /// has arrived yet (the next reply's starts it).
    fn start_connect(&mut self, peer: PeerId) {
        let Some(&credential) = self.credentials.get(&peer) else {
            return;
        };
        if !self.connecting.insert(peer) {
            return;
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
            // Bounded: about five minutes of attempts, backing off to 5 s between them. An
            // incompatible or unauthorised answer ends them at once: retrying cannot help.
            let mut last = String::new();
            for attempt in 0..64u32 {
                match env.fabric().connect(&addr.fabric, memory.clone(), credential).await {
                    Ok(conn) => {
                        let _ = cmd_tx.send(Cmd::FabricBack(peer, conn, credential));
                        return;
                    }
                    Err(e @ (FabricError::Incompatible { .. } | FabricError::Unauthorized(..))) => {
                        tracing::error!(%peer, error = %e, "cannot attach to the receiver's fabric");
                        let _ = cmd_tx.send(Cmd::FabricGaveUp(peer, e));
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, attempt, "fabric connect failed");
                        last = e.to_string();
                    }
                }
                if cmd_tx.is_closed() {
                    return;
                }
                // The environment's clock, as everywhere in the drivers (the simulation's
                // under madsim).
                let backoff = Duration::from_millis((100u64 << attempt.min(6)).min(5_000));
                env.sleep_until(env.now() + backoff).await;
            }
            tracing::error!(%peer, "giving up connecting the fabric; writes to this receiver fail");
            let _ = cmd_tx.send(Cmd::FabricGaveUp(peer, FabricError::Io(format!("gave up connecting the fabric: {last}"))));
        });
    }
}
