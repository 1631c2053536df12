//! The checks after every step and at the end of a run, the dump a stuck run reports, and
//! the one-line event descriptions of `KVX_TRACE`.

use super::*;

impl Cluster {
    pub(super) fn check(&self) -> Result<(), Violation> {
        for node in &self.senders {
            node.flow.check_invariants();
        }
        for node in &self.receivers {
            node.ledger.check_invariants();
        }
        self.proxy.check_invariants();
        self.checker.first_violation()
    }

    pub(super) fn check_final(&self) -> Result<(), Violation> {
        self.check()?;
        let killed: BTreeSet<usize> = self.spec.kill_sender_after.iter().map(|k| k.0).collect();
        for (i, plan) in self.spec.requests.iter().enumerate() {
            let rep = &self.report.plans[i];
            if !killed.contains(&plan.sender) && rep.sender_end.is_none() {
                return Err(Violation::new(format!(
                    "request {} never ended at its sender",
                    plan.req_id
                )));
            }
            if rep.begun_at.is_some() && rep.proxy_end.is_none() {
                return Err(Violation::new(format!(
                    "the proxy never learned how {} ended",
                    plan.req_id
                )));
            }
            if rep.sender_end == Some(End::Delivered)
                && self.spec.decoder_consumes
                && rep.consumed_at.is_none()
            {
                return Err(Violation::new(format!(
                    "delivered request {} was never consumed",
                    plan.req_id
                )));
            }
        }
        for (r, node) in self.receivers.iter().enumerate() {
            if !node.ledger.is_quiescent() {
                return Err(Violation::new(format!(
                    "receiver {r} is not entirely free after quiescence: {} tracked, {} free of {}",
                    node.ledger.tracked_requests(),
                    node.ledger.free_slots(),
                    node.ledger.capacity()
                )));
            }
        }
        for (s, node) in self.senders.iter().enumerate() {
            if node.alive && !node.flow.is_quiescent() {
                return Err(Violation::new(format!(
                    "sender {s} still holds state after quiescence"
                )));
            }
        }
        Ok(())
    }

    pub(super) fn stuck(&self, reason: String) -> Stuck {
        let mut dump = format!(
            "at {:?} after {} steps\n",
            self.now.since_epoch(),
            self.report.steps
        );
        for (i, plan) in self.spec.requests.iter().enumerate() {
            let rep = &self.report.plans[i];
            if rep.sender_end.is_none() || rep.proxy_end.is_none() {
                dump += &format!("  {}: {:?}\n", plan.req_id, rep);
            }
        }
        for (r, node) in self.receivers.iter().enumerate() {
            let l = &node.ledger;
            dump += &format!(
                "  receiver {r}: tracked {} queued {} reserved {} held {} quarantined {} free {}\n",
                l.tracked_requests(),
                l.admission_queue_len(),
                l.reserved_total(),
                l.held_slots(),
                l.quarantined_slots(),
                l.free_slots()
            );
        }
        for (s, node) in self.senders.iter().enumerate() {
            dump += &format!(
                "  sender {s}: alive {} tracked {} staging free {}/{}\n",
                node.alive,
                node.flow.tracked_requests(),
                node.flow.staging_free(),
                node.flow.staging_capacity()
            );
        }
        Stuck {
            reason,
            dump,
            report: Box::new(self.report.clone()),
        }
    }

    #[doc(hidden)]
    pub fn pending_write_ids(&self) -> Vec<WriteId> {
        self.queue
            .values()
            .filter_map(|e| {
                if let Ev::WriteLands { op, .. } = e {
                    Some(op.id)
                } else {
                    None
                }
            })
            .collect()
    }
}

/// One line per event for `KVX_TRACE`: messages are decoded so the trace reads as protocol.
pub(super) fn describe(ev: &Ev) -> String {
    let msg =
        |bytes: &[u8]| wire::decode(bytes).map_or_else(|e| format!("<{e}>"), |m| format!("{m:?}"));
    match ev {
        Ev::ToReceiver { from, r, bytes } => format!("{from} -> receiver {r}: {}", msg(bytes)),
        Ev::ToSender { r, s, bytes } => format!("receiver {r} -> sender {s}: {}", msg(bytes)),
        Ev::ToRaw { peer, bytes } => format!("-> {peer}: {}", msg(bytes)),
        Ev::ToProxy { bytes } => format!("-> proxy: {}", msg(bytes)),
        Ev::WriteLands { s, op, fail, .. } => {
            format!(
                "sender {s} write {} {} chunk {} -> slot {}{}",
                op.id.0,
                op.req_id,
                op.chunk,
                op.remote.0,
                if *fail { " FAILS" } else { "" }
            )
        }
        other => format!("{other:?}"),
    }
}
