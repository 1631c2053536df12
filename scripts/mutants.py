#!/usr/bin/env python3
"""Deliberately broken variants of kvx-proto (and of the fabrics' access rules), each of which
the tests must catch.

Applies one mutation at a time to the checkout itself, runs the scenario and property tests
(or, for a variant outside kvx-proto, the tests it names) in the workspace's own target
folder, so each variant rebuilds only the crates it touches and reuses every dependency the
workspace built, then puts the file back, and reports whether the tests failed (caught) or
passed (missed). The original of a file under mutation waits in target/mutant-originals/
until it is put back; a run that was killed leaves it there, and the next run restores it
first. Don't edit a file while its variant runs.

Usage: python3 scripts/mutants.py [--curve] [NAME ... | --check | --changed]
  (no names: every variant; --check: only that every pattern still applies; --changed: the
  patterns, then the variants whose file changed since the last full evidence run; see
  scripts/mutant_selection.py). Exit status 1 if any is missed or stale.
`--list` prints the names and what each breaks. `--self-test` shows that a variant that does not
compile is reported as an error: only tests that fail count as a catch.

`--curve` runs instead the broken variants of the ZMQ transport's CURVE mechanism
(`CURVE_MUTANTS`) against kvx-transport's unit tests and `tests/zmq_curve.rs` (which needs
python3 with pyzmq: KVX_REQUIRE_PYTHON=1 is set, so a missing pyzmq is a failure, not a skip).
The simulation's `--break` variants are compiled in (`sim/sweeps.sh` runs them).
"""
import os, re, signal, subprocess, sys

import mutant_selection

ROOT = mutant_selection.ROOT
ORIGINALS = os.path.join(ROOT, "target/mutant-originals")
SRC = "crates/kvx-proto/src/"

# The tests a variant of kvx-proto runs against.
PROTO_TESTS = ["-p", "kvx-proto", "--test", "scenarios", "--test", "properties", "--test", "explore", "--test", "ledger_integrity", "--test", "ledger_bounds", "--test", "fair_shares", "--test", "sender_replies", "--test", "staging_order", "--test", "caller_staging", "--test", "admission_deadline", "--test", "proxy_dropped_notices", "--test", "admission_order", "--test", "proxy_early_notices", "--test", "proxy_binding"]

# name: (file, old, new, what it breaks[, the `cargo test` selection that must catch it])
MUTANTS = {
    "no-reservation": (SRC + "admission.rs",
        "if next == Some(behind) && need <= self.available() {",
        "if true {",
        "admit every request without checking capacity"),
    "release-before-complete": (SRC + "receiver/batch.rs",
        "let unused = req.reservation - req.slots.len() as u32;",
        "let unused = req.reservation;",
        "release the whole reservation when the last batch is allocated (LMCache W12)"),
    "proxynotif-before-written": (SRC + "sender/lifecycle.rs",
        "&& req.writes_in_flight == 0\n            && req.written == req.submitted;",
        ";",
        "send ProxyNotif when the last batch is answered, before the writes complete (LMCache U, W8)"),
    "reuse-slot-early": (SRC + "receiver/mod.rs",
        "if drained {\n                self.slots.release(tag.slot);",
        "if true {\n                self.slots.release(tag.slot);",
        "free a rolled-back request's slots at once, though a write may still land"),
    "stage-before-admit": (SRC + "sender/mod.rs",
        "(State::Admitting, _) => Err(SendError::NotAdmitted(req_id.clone())),",
        "(State::Admitting, _) => Ok(req),",
        "let a request take staging before its receiver admitted it"),
    "lock-across-admission": (SRC + "sender/lifecycle.rs",
        "State::Admitted => true,",
        "State::Admitted => !r.last_acked && false,",
        "on a serial channel, send a probe while another admitted request still needs the channel (LMCache W1)"),
    "no-cancel-release": (SRC + "receiver/mod.rs",
        "        if self.requests.contains_key(&key) {\n            self.fail(now, &key, Failure::Cancelled, drained);",
        "        if false {\n            self.fail(now, &key, Failure::Cancelled, drained);",
        "acknowledge CancelNotif without releasing anything"),
    "no-fifo": (SRC + "admission.rs",
        "if !passed_over.contains(&w.peer) && self.within_share(w.peer, w.need) {",
        "if !passed_over.contains(&w.peer) && self.within_share(w.peer, w.need) && w.need <= self.available() {",
        "let a smaller waiter overtake the head of the admission queue"),
    "staging-order-ignored": (SRC + "sender/allocate.rs",
        "if free > 0 && older_waiting >= free {",
        "if false && free > 0 && older_waiting >= free {",
        "hand a freed staging slot to a younger request while an older one waits for it"),
    "caller-staging-unread": (SRC + "sender/mod.rs",
        "chunks.iter().for_each(|c| self.staging.read(c.staging));",
        "let _ = &chunks;",
        "with caller staging, count no read of a slot a submitted chunk names (S13)"),
    "drained-while-writes-read": (SRC + "sender/lifecycle.rs",
        "        self.events.push_back(SenderEvent::Failed {\n            req_id: req_id.clone(),\n            failure,\n        });",
        "        self.events.push_back(SenderEvent::Failed {\n            req_id: req_id.clone(),\n            failure,\n        });\n        if self.staging.is_callers() {\n            self.events.push_back(SenderEvent::Drained { req_id: req_id.clone() });\n        }",
        "tell the application a failed request's slots are free while its posted writes still read them (S13)"),
    "waiter-blocks-its-own-holder": (SRC + "sender/allocate.rs",
        "        let Some(slot) = self.staging.take(req_id) else {",
        "        if older_waiting > 0 {\n            return Err(SendError::WouldBlock);\n        }\n        let Some(slot) = self.staging.take(req_id) else {",
        "queue a request that holds unsubmitted staging behind an older waiter (a deadlock)"),
    "landing-from-any-peer": (SRC + "slots.rs",
        "if !unheld && self.holder(tag.slot) != Some(peer) {",
        "if false {",
        "count a landing whatever peer's connection it came through (the forged-landing defect)"),
    "ignore-checksum-mismatch": (SRC + "receiver/landing.rs",
        "ChecksumCheck::Mismatch { .. } => Some(format!(",
        "ChecksumCheck::Mismatch { .. } if false => Some(format!(",
        "make a request ready although a chunk failed its checksum"),
    "landing-of-any-length": (SRC + "receiver/landing.rs",
        "if w.bytes != declared {",
        "if w.bytes != declared && false {",
        "count a landing whatever its length: a short write completes its chunk (the decoder reads the previous request's bytes for the rest)"),
    "legacy-ready-on-allocation": (SRC + "receiver/mod.rs",
        "let ready = matches!(req.phase, Phase::Complete) && all_landed && req.notices;",
        "let ready = matches!(req.phase, Phase::Complete) && (all_landed || !req.notices);",
        "make an LMCache sender's request ready as soon as it is allocated (defect 6)"),
    "no-peer-share": (SRC + "admission.rs",
        "        self.limits.peer_cap >= self.limits.capacity\n            || held == 0\n            || held + need <= self.limits.peer_cap",
        "        let _ = held;\n        true",
        "a share that never binds: a sender past its share is admitted while another sender's waiter is within its own"),
    "share-refuses-what-fits": (SRC + "admission.rs",
        "        if broken_variant!(NoReservation) {",
        "        if need > limits.peer_cap {\n            return Decision::Refused(Refusal::PeerQueueFull { max: limits.peer_queue_max });\n        }\n        if broken_variant!(NoReservation) {",
        "refuse a request larger than one sender's share though it fits the buffer"),
    "pass-over-without-contender": (SRC + "admission.rs",
        "any.then_some(0)",
        "any.then_some(0).filter(|_| false)",
        "pass over a waiter past its share when no other sender's waiter is within its own (the buffer idles)"),
    "unbounded-queued-bytes": (SRC + "receiver/batch.rs",
        "if self.queued_bytes + bytes > self.cfg.queued_bytes_max {",
        "if false {",
        "keep every waiting first batch, whatever it holds"),
    "duplicate-grant-accepted": (SRC + "sender/reply.rs",
        "if let Some(dup) = reply.remote_indexes.iter().find(|&&i| !seen.insert(i)) {",
        "if let Some(dup) = reply.remote_indexes.iter().find(|&&i| !seen.insert(i) && false) {",
        "write two chunks of a batch into one slot a receiver granted twice"),
    "no-admission-deadline": (SRC + "admission.rs",
        "self.waiting.front().map(|w| w.deadline)",
        "None",
        "give the ledger no timer for the admission queue's head: a waiting request times out only when another timer fires"),
    "admit-at-once-by-another-rule": (SRC + "admission.rs",
        "if next == Some(behind) && need <= self.available() {",
        "if self.waiting.iter().all(|w| w.peer != peer && !self.within_share(w.peer, w.need))\n            && self.within_share(peer, need)\n            && need <= self.available()\n        {",
        "decide who is ahead of a new request waiter by waiter, not with the queue's rule: a request that fits waits behind passed-over waiters until something re-runs the queue"),
    "early-order-keeps-stale-entries": (SRC + "proxy/mod.rs",
        "self.early_order.remove(&early.order);",
        "",
        "leave a repeated early notice's old order entry behind: the order grows with every repeat and pushes out count stale entries as drops"),
    "allocate-keeps-held-batch": (SRC + "sender/batching.rs",
        "Err(SendError::StagingHeldByCaller(_)) if !held.is_empty() => {",
        "Err(SendError::StagingHeldByCaller(_)) if false => {",
        "allocate_or_submit answers StagingHeldByCaller instead of submitting the caller's batch: every caller must write the submit-and-retry step itself"),
    "pending-batches-never-flushed": (SRC + "sender/batching.rs",
        "if broken_variant!(NoPendingFlush)\n            || self.staging.free_count() > 0\n            || !self.staging_held_by_callers()\n        {",
        "if true {",
        "never submit the pending batches (handle_add) when only they hold staging: an allocate call waits on chunks its own caller added (S11)"),
    "free-slots-callers-hold": (SRC + "sender/lifecycle.rs",
        "if added.contains(&slot) {",
        "if true {",
        "a failed request's staging slots its caller still holds (taken, not added) go back to the pool at once: the next request's chunk may share a slot with a write still under way (S12)",
        ["-p", "kvx-proto", "--test", "sender_bookkeeping", "a_cancelled_requests_slots"]),
    "add-leaves-waiters-waiting": (SRC + "sender/batching.rs",
        "if !self.waiters.is_empty() {\n            self.flush_when_only_callers_hold_staging(now);",
        "if false {\n            self.flush_when_only_callers_hold_staging(now);",
        "an add while an allocate call waits and only unsubmitted chunks hold staging submits nothing: the call waits out its timeout (S11)",
        ["-p", "kvx-embed", "--test", "transfer", "a_waiting_allocate"]),
    "placement-returned-under-quarantine": (SRC + "receiver/placement.rs",
        ".any(|&s| self.slots.state(s) != SlotState::Caller)",
        ".any(|_| false)",
        "caller placement: a withdrawn reservation goes back to the application while a write of its grants may still land",
        ["-p", "kvx-proto", "--test", "ledger_placement", "a_withdrawal"]),
    "placement-claimed-twice": (SRC + "receiver/placement.rs",
        "            PlacedState::Open { .. } => None,",
        "            _ => None,",
        "caller placement: a second connection's claim of a reserved id is admitted as if it were the first",
        ["-p", "kvx-proto", "--test", "ledger_placement", "claimed_once"]),
    "chunk-size-unchecked": (SRC + "receiver/batch.rs",
        "(chunk > slot).then_some(Failure::ChunkSizeMismatch { chunk, slot })",
        "(false && chunk > slot).then_some(Failure::ChunkSizeMismatch { chunk, slot })",
        "a batch declaring chunks longer than the receiver's slots is granted: the request fails only at its first write, without naming the two sizes",
        ["-p", "kvx-proto", "--test", "ledger_placement", "chunks_longer"]),
    "stall-any-waiter": (SRC + "receiver/stalls.rs",
        "if self.admission.waits_for_other_than(own) {",
        "if self.admission.queue_len() > 0 {",
        "a request whose only waiters are its own principal's is stalled all the same: a sender's second request takes its first one's reservation",
        ["-p", "kvx-proto", "--test", "stalled_reservations"]),
    "stall-not-renewed-by-landings": (SRC + "receiver/landing.rs",
        "                self.stall_progress(ticket, notices, now);",
        "                let _ = (ticket, notices);",
        "a chunk that lands does not move its request's stall deadline: a request landing at the fabric's pace is stalled while another waits",
        ["-p", "kvx-proto", "--test", "stalled_reservations"]),
    "pong-never-sent": ("crates/kvx-transport/src/zmq/server.rs",
        "                let _ = pongs.try_send(context);",
        "                let _ = (&pongs, context);",
        "a ROUTER that never answers PING: kvx senders give up live receivers every heartbeat_timeout",
        ["-p", "kvx-transport", "--test", "zmq_heartbeats"]),
    "router-no-silence-deadline": ("crates/kvx-transport/src/zmq/server.rs",
        "    let heartbeats = announces_heartbeats(&props);",
        "    let heartbeats = announces_heartbeats(&props) && false;",
        "a ROUTER that never holds a pinging DEALER to heartbeat_timeout: a hung sender's requests wait out request_idle_timeout",
        ["-p", "kvx-transport", "--test", "zmq_heartbeats"]),
    "dealer-no-silence-deadline": ("crates/kvx-transport/src/zmq/dealer.rs",
        "                () = tokio::time::sleep_until(last_heard + liveness), if heartbeats => {",
        "                () = tokio::time::sleep_until(last_heard + liveness), if heartbeats && false => {",
        "a DEALER that never gives up a ROUTER that stopped answering heartbeats: a hung receiver's sender waits out recv_timeout",
        ["-p", "kvx-transport", "--test", "zmq_heartbeats"]),
    "restart-not-told": ("crates/kvx-transport/src/zmq/peers.rs",
        "        let restarted = entry.epoch.is_some_and(|before| before != epoch);",
        "        let restarted = false;",
        "a ROUTER that takes a restarted sender (a new epoch under its identity) for the old one",
        ["-p", "kvx-transport", "--lib", "--test", "zmq_epochs"]),
    "lost-sender-kept": (SRC + "receiver/mod.rs",
        "        for key in open {\n            self.fail(now, &key, Failure::SenderLost, false);\n        }",
        "        let _ = open;",
        "a sender whose control connection closed keeps its requests and their slots until the idle or admission timeout",
        ["-p", "kvx-proto", "--test", "lost_senders"]),
    "lost-sender-fails-ready": (SRC + "receiver/mod.rs",
        "            .filter(|(_, r)| !matches!(r.phase, Phase::Ready))\n",
        "",
        "a lost sender's ready requests fail too: the decoder loses bytes that all landed and were verified",
        ["-p", "kvx-proto", "--test", "lost_senders"]),
    "no-stall-rule": (SRC + "receiver/stalls.rs",
        "        if self.admission.queue_len() == 0 {\n            return;\n        }\n        while",
        "        if true {\n            return;\n        }\n        while",
        "no reservation is ever taken back for stalling: a trickling hog holds the buffer for its requests' lifetime",
        ["-p", "kvx-proto", "--test", "stalled_reservations"]),
    "claim-secret-unchecked": (SRC + "receiver/placement.rs",
        "        if !placed.secret.proven_by(presented) {",
        "        if presented.is_none() {",
        "caller placement: a first batch with any claim secret claims a reservation it knows the id of: the request id alone is all an attacker needs",
        ["-p", "kvx-proto", "--test", "ledger_placement", "secret"]),
    "placement-held-chunks-granted": (SRC + "receiver/batch.rs",
        "let held_here = req.held_left.min(msg.keys.len() as u32);",
        "let held_here = 0u32.min(msg.keys.len() as u32);",
        "caller placement: the chunks a reservation says the application holds are granted slots as if they were to be written",
        ["-p", "kvx-proto", "--test", "ledger_placement", "held"]),
    "placement-held-chunks-unanswered": (SRC + "receiver/batch.rs",
        "reply.already_sent_indexes = (0..i64::from(held_here)).collect();",
        "let _ = held_here;",
        "caller placement: the sender is not told which chunks the application holds, so its reply names fewer slots than its batch has chunks",
        ["-p", "kvx-proto", "--test", "explore", "caller_placement_holding"]),
    "placement-revoked-without-the-fabric": (SRC + "receiver/mod.rs",
        "let revoked = self.cfg.placement == Placement::Caller && self.revocation_stops_writes;",
        "let revoked = self.cfg.placement == Placement::Caller;",
        "caller placement: a failed request's slots go back to the application at once on every fabric, though over RDMA its write may still land",
        ["-p", "kvx-proto", "--test", "explore", "caller_placement_requests_contending"]),
    "dropped-lease-kept": ("crates/kvx-node/src/lease.rs",
        "if !self.done {\n            self.link.release(&self.ready.key);",
        "if !self.done {\n            let _ = &self.link;",
        "a read lease dropped unconsumed never releases its request: its slots stay held until the unconsumed TTL",
        ["-p", "kvx-embed", "--test", "transfer", "a_dropped_lease"]),
    "runs-never-joined": ("crates/kvx-node/src/sender/driver/fabric_link.rs",
        "if *last_req == req_id && run.push(write, slot_bytes).is_ok() {",
        "if *last_req == req_id && run.push(write, slot_bytes).is_ok() && false {",
        "post every chunk as a write of its own: writes per request are chunks, not runs",
        ["-p", "kvx-node", "--test", "caller_staging", "consecutive_chunks"]),
    "run-joins-scattered-slots": ("crates/kvx-io/src/fabric.rs",
        "            && last.remote.0.checked_add(1) == Some(next.remote.0)",
        "",
        "join writes into a run whose remote slots are not consecutive (not one span on the receiver)",
        ["-p", "kvx-node", "--test", "caller_staging", "consecutive_chunks"]),
    "run-payload-read-as-header": ("crates/kvx-transport/src/tcp_fabric/receiver_conn.rs",
        "let next_header = if self.run.is_empty() { HEADER_LEN } else { 0 };",
        "let next_header = HEADER_LEN;",
        "read a run's next piece's first bytes as a header",
        ["-p", "kvx-transport", "--test", "fabric_tcp", "runs"]),
    "run-headers-unflagged": ("crates/kvx-transport/src/tcp_fabric/mod.rs",
        "                header.flags |= FLAG_RUN;",
        "                header.flags |= 0;",
        "send a run's headers without FLAG_RUN (the receiver takes the next header as payload)",
        ["-p", "kvx-transport", "--test", "fabric_tcp", "runs"]),
    "run-split-staging-from-first-slot": ("crates/kvx-transport/src/tcp_fabric/mod.rs",
        "        let i = (at / slot_bytes).min(self.writes.len() - 1);",
        "        let i = 0;",
        "send a run over staging in parts from its first piece's slot only",
        ["-p", "kvx-transport", "--test", "fabric_tcp", "runs"]),
    "run-trusts-its-slot-size": ("crates/kvx-transport/src/tcp_fabric/sender.rs",
        "let whole = checks.iter().all(Result::is_ok) && run.fits(slot_bytes);",
        "let whole = checks.iter().all(Result::is_ok);",
        "carry as one write a run built for another slot size (its payload taken as whole slots)",
        ["-p", "kvx-transport", "--test", "fabric_tcp", "runs"]),
    "version-2-senders-refused": ("crates/kvx-transport/src/tcp_fabric/link.rs",
        "let status = if !ACCEPTED_VERSIONS.contains(&base.version) {",
        "let status = if base.version != VERSION {",
        "refuse senders of the previous version, which never send runs (receivers cannot upgrade first)",
        ["-p", "kvx-transport", "--test", "fabric_tcp", "runs"]),
    "run-count-trusted": ("crates/kvx-transport/src/tcp_fabric/receiver_conn.rs",
        "if h.flags & !FLAGS_KNOWN != 0 || continued != (i + 1 < count) || h.run != 0 {",
        "if h.flags & !FLAGS_KNOWN != 0 {",
        "take a run's headers as its first header counts them, whatever their flags say",
        ["-p", "kvx-transport", "--test", "fabric_tcp", "runs"]),
    "stages-reused-memory-without-checksums": (SRC + "config.rs",
        "    pub fn may_stage_reused_memory_in_place(&self) -> bool {\n        self.checksums",
        "    pub fn may_stage_reused_memory_in_place(&self) -> bool {\n        true",
        "stage memory its owner may reuse mid-write (a vLLM engine's blocks) in place without checksums, where a changed chunk would land unnoticed",
        ["-p", "kvx-proto", "--lib", "config"]),
    "lost-lease-handover": ("crates/kvx-node/src/handover.rs",
        "if let Ok(Ok(items)) = self.taken.try_recv() {\n            self.back.give_back(items);",
        "if let Ok(Ok(items)) = self.taken.try_recv() {\n            drop(items);",
        "leases a cut-short `take` had taken are dropped (released unread) instead of handed to the next call",
        ["-p", "kvx-embed", "--test", "transfer", "a_ready_future_dropped"]),
    "lost-lease-after-cancel": ("crates/kvx-node/src/handover.rs",
        "if let Err(Ok(items)) = self.tx.send(result) {\n            self.back.give_back(items);",
        "if let Err(Ok(items)) = self.tx.send(result) {\n            drop(items);",
        "leases made for a call that was cut short before they reached it are dropped (released unread) instead of handed to the next call",
        ["-p", "kvx-embed", "--test", "transfer", "a_ready_future_dropped"]),
    "given-back-dropped": ("crates/kvx-node/src/handover.rs",
        "        self.lock().extend(items);",
        "        drop(items);",
        "items a caller gave back (returned reservations a cancelled await had taken, leases) are dropped instead of handed to the next call",
        ["-p", "kvx-node", "--lib", "handover"]),
    "given-back-unheard": ("crates/kvx-node/src/handover.rs",
        "        self.lock().extend(items);\n        self.arrived.notify_waiters();",
        "        self.lock().extend(items);",
        "items given back do not wake a caller already waiting: it waits for the stream's next item",
        ["-p", "kvx-node", "--lib", "handover"]),
    "dropped-notices-counted-down": (SRC + "proxy/mod.rs",
        "_ => self.dropped_notices += 1,",
        "_ => self.dropped_notices -= 1,",
        "count a notice the proxy drops (over-long id, not a notice) down instead of up"),
    "notices-from-anyone": (SRC + "proxy/binding.rs",
        "        if !self.connections.is_empty() && self.principal != from.principal {\n            return Err(NoticeRefusal::OtherPrincipal);\n        }\n        if rank && self.ranks_of(from.connection) >= per_connection {",
        "        if false {\n            return Err(NoticeRefusal::OtherPrincipal);\n        }\n        if false && rank && self.ranks_of(from.connection) >= per_connection {",
        "count every notice whoever sent it, as before the binding: another allowed key's ProxyNotif and FailNotif for a request, and one connection's repeat as another TP rank",
        ["-p", "kvx-proto", "--test", "proxy_binding", "-p", "kvx-node", "--test", "proxy_binding_zmq"]),
    "write-outlives-grant": ("crates/kvx-io/src/access.rs",
        "if cell.epoch != write.epoch {",
        "if false && cell.epoch != write.epoch {",
        "let an admitted write go on landing bytes after its grant was revoked: a write stopped half-way and finished after the slot was granted again overwrites the new holder's chunk",
        ["-p", "kvx-io", "-p", "kvx-transport", "--lib", "--test", "fabric_tcp"]),
    "layers-never-one-range": ("crates/kvx-io/src/region.rs",
        "        let (ptrs, part_slots) = if end_to_end {",
        "        let (ptrs, part_slots) = if false && end_to_end {",
        "keep per-layer views of one allocation as separate parts: RDMA refuses the vLLM connector's host buffer, which it could register as one region",
        ["-p", "kvx-rdma", "--lib", "tests_node"]),
    "rdma-side-channel-unbudgeted": ("crates/kvx-rdma/src/receiver.rs",
        "    let budget = ConnectionBudget::new(\n        device.config.connections_max,\n        device.config.connections_per_source_max,\n    );",
        "    let budget = ConnectionBudget::new(usize::MAX, usize::MAX);",
        "let the RDMA side channel hold every idle connection: a flood of sockets that never greet stays open until its hello deadline",
        ["-p", "kvx-rdma", "--lib", "idle_side_channel"]),
    "rdma-hello-per-frame": ("crates/kvx-rdma/src/receiver.rs",
        "let hello_by = tokio::time::Instant::now() + self.device.config.hello_timeout;",
        "let hello_by = tokio::time::Instant::now() + self.device.config.connect_timeout;",
        "bound an RDMA side-channel hello by the sender's connect timeout instead of the receiver's short hello deadline",
        ["-p", "kvx-rdma", "--lib", "a_hello_that_never_ends"]),
    "rdma-dead-device-takes-peers": ("crates/kvx-rdma/src/receiver.rs",
        "        if let Some(why) = self.device.unusable() {\n            if let Some(left_out)",
        "        if let Some(why) = None::<&str> {\n            if let Some(left_out)",
        "let a receiver whose RDMA device failed go on setting up queue pairs for new senders",
        ["-p", "kvx-rdma", "--lib", "a_receiver_on_a_failed_device"]),
    "rdma-event-reader-spins": ("crates/kvx-rdma/src/device.rs",
        "                dev.fail(&why);\n                return;",
        "                dev.fail(&why);\n                continue;",
        "keep asking a removed device for events: its channel answers at once, so the reader spins a core",
        ["-p", "kvx-rdma", "--lib", "a_removed_device_ends"]),
    "rdma-port-never-refreshed": ("crates/kvx-rdma/src/device.rs",
        "| DeviceEvent::SmChange { port } => match self.verbs.refresh_port() {",
        "| DeviceEvent::SmChange { port } => match Ok::<_, crate::verbs::VerbsError>(self.verbs.port()) {",
        "leave the LID and GID read at open after LID_CHANGE, GID_CHANGE or SM_CHANGE: new connections advertise a stale address",
        ["-p", "kvx-rdma", "--lib", "a_lid_change_refreshes"]),
    "rdma-no-drain-after-qp-fatal": ("crates/kvx-rdma/src/receiver.rs",
        "device_broke = !completions_follow;",
        "device_broke = completions_follow || true;",
        "skip the receiver's drain when its queue pair failed (QP_FATAL) though the completion queue works: writes the sender saw succeed are never announced",
        ["-p", "kvx-rdma", "--lib", "a_fatal_queue_pair_still_announces"]),
    "rdma-transitions-on-the-runtime": ("crates/kvx-rdma/src/verbs.rs",
        "match crate::blocking::off_the_runtime(|| inner.modify(to)) {",
        "match inner.modify(to) {",
        "move a queue pair (INIT, ERROR, ...) on the tokio worker that asks: a firmware command holds up every task on that worker",
        ["-p", "kvx-rdma", "--lib", "blocking_verbs_calls"]),
    "rdma-dereg-on-the-runtime": ("crates/kvx-rdma/src/memory.rs",
        "crate::blocking::off_the_runtime(|| drop(registration));",
        "drop(registration);",
        "deregister memory (unpinning it) on the tokio worker that drops its last handle",
        ["-p", "kvx-rdma", "--lib", "blocking_verbs_calls"]),
    "rdma-checksum-not-compared": ("crates/kvx-rdma/src/receiver.rs",
        "if computed == carried && len == byte_len {",
        "if true {",
        "announce every RDMA write's checksum as matching without comparing it with the landed bytes: a byte that changed after the NIC wrote it reaches the decoder",
        ["-p", "kvx-rdma", "--lib", "checksum"]),
    "rdma-frames-bound-by-slots-alone": ("crates/kvx-rdma/src/receiver.rs",
        "let in_flight_max = self.memory.slots() as usize + posted as usize;",
        "let in_flight_max = self.memory.slots() as usize;",
        "bound an RDMA connection's unpaired write frames by the buffer's slots alone, forgetting the landed writes whose completions are not yet taken: under a steady stream writes go unchecked (announced without their checksum)",
        ["-p", "kvx-rdma", "--lib", "tests_checksum::"]),
    "decoder-reads-nothing": ("crates/kvx-node/src/synthetic.rs",
        "    if check {\n        let req_id = &lease.key().req_id.0;",
        "    if false {\n        let req_id = &lease.key().req_id.0;",
        "the receiver's decoder releases each request without reading it: every \"no corrupt bytes read\" check then passes whatever landed",
        ["-p", "kvx", "--test", "hostile_fabric"]),
    "cross-user-peer-run-in-place": ("crates/kvx-transport/tests/shm_trust.rs",
        "let mut cmd = Command::new(&self.exe);",
        "let mut cmd = Command::new(std::env::current_exe().expect(\"this binary\"));",
        "run the cross-user tests' `nobody` peer from the test binary where it lies: from a checkout in a private directory it cannot start, and the checks fail for a reason not theirs",
        ["-p", "kvx-transport", "--test", "shm_trust"]),
    "handoff-keeps-every-descriptor": ("crates/kvx-transport/src/shm_fabric/handoff.rs",
        "                            }\n                            // Past the first, each is dropped (closed) here.",
        "                            } else {\n                                std::mem::forget(fd);\n                            }",
        "keep every descriptor a handoff peer sends with its offer's bytes: a peer that trickles its offer with descriptors takes the receiver to its open-files limit",
        ["-p", "kvx-transport", "--test", "shm_hoarding"]),
    "ghost-claims-unbudgeted": (SRC + "receiver/placement.rs",
        "        if own >= limits.peer_cap.max(1) {",
        "        if false && own >= limits.peer_cap.max(1) {",
        "let one principal's claims for ids nobody reserved wait without its share's bound",
        ["-p", "kvx-proto", "--test", "ledger_placement"]),
    "reserved-claim-counts-against-requests-max": (SRC + "receiver/batch.rs",
        "        if self.cfg.placement == Placement::Caller {\n            // Its own budgets",
        "        if self.cfg.placement == Placement::Caller && self.requests.len() < self.cfg.requests_max {\n            // Its own budgets",
        "refuse the claim of a reservation that is out because the request table is full of claims for ids nobody reserved",
        ["-p", "kvx-proto", "--test", "ledger_placement"]),
    "authenticated-eviction-takes-the-quietest-anywhere": ("crates/kvx-io/src/budget.rs",
        "            let closed = table.evict(Some(from), others)",
        "            let closed = table.evict(None, others)",
        "past the total cap, an authenticated newcomer closes the quietest authenticated connection anywhere: idlers from a few addresses close a lone sender's idle connection",
        ["-p", "kvx-io", "--lib", "budget"]),
    "checksum-ahead-of-landing": ("crates/kvx-io/src/checksum/xxh3_long.rs",
        "let upto = (landed.len() / STRIPE).min(self.normal_stripes());",
        "let upto = (landed.len() / STRIPE + 1).min(self.normal_stripes());",
        "fold a stripe into a landing chunk's checksum before all of its bytes have landed: the checksum covers stale slot bytes",
        ["-p", "kvx-io", "--lib", "checksum"]),
    "checksum-copy-skips-scramble": ("crates/kvx-io/src/checksum/xxh3_long.rs",
        "            if end == block_end {\n                scramble(&mut lanes);",
        "            if false {\n                scramble(&mut lanes);",
        "leave out the AVX2 kernel's scramble: the checksum taken during a copy is no longer XXH3, so it never matches a sender's",
        ["-p", "kvx-io", "--lib", "checksum"]),
}

ZMQ = "crates/kvx-transport/src/zmq/"

# The CURVE mechanism's variants: name: (file, [(old, new), ...] each replaced everywhere,
# what it breaks). The ones changed "on both sides" stay consistent between two kvx ends:
# only libzmq (pyzmq) notices them.
CURVE_MUTANTS = {
    "server-opens-with-the-servers-prefix": (ZMQ + "curve.rs",
        [("cipher: salsa(&client_transient, &transient),\n        prefix: b\"CurveZMQMESSAGEC\",",
          "cipher: salsa(&client_transient, &transient),\n        prefix: b\"CurveZMQMESSAGES\",")],
        "a CURVE server opens its client's MESSAGE boxes with the server's nonce prefix"),
    "message-prefixes-swapped-on-both-sides": (ZMQ + "curve.rs",
        [('b"CurveZMQMESSAGEC"', 'b"@@"'), ('b"CurveZMQMESSAGES"', 'b"CurveZMQMESSAGEC"'),
         ('b"@@"', 'b"CurveZMQMESSAGES"')],
        "the client's and the server's MESSAGE nonce prefixes swapped, at both ends"),
    "vouch-prefix-changed-on-both-sides": (ZMQ + "curve.rs",
        [('b"VOUCH---"', 'b"VOUCH--+"')],
        "the vouch's nonce prefix changed, at both ends"),
    "no-allow-list": (ZMQ + "curve.rs",
        [("if !allowed.contains(&client_key)", "if false && !allowed.contains(&client_key)")],
        "a CURVE server accepts any client key that proves itself"),
    "no-replay-check": (ZMQ + "curve_box.rs",
        [("if n <= self.last {", "if false && n <= self.last {")],
        "a MESSAGE whose nonce is not above the last is opened (a replayed box accepted)"),
    "box-opened-without-its-tag": (ZMQ + "curve_box.rs",
        [("crypto_box::aead::Tag::<A>::from_slice(tag),\n        )\n        .ok()?;",
          "crypto_box::aead::Tag::<A>::from_slice(tag),\n        )\n        .ok();")],
        "a box whose tag does not authenticate is opened all the same"),
    "principal-ignores-the-key": (ZMQ + "mod.rs",
        [("match (key, source.to_canonical()) {",
          "match (None::<[u8; 32]>, source.to_canonical()) {")],
        "a CURVE peer's principal is its address, not the key it proved"),
    "identity-not-bound-to-key": (ZMQ + "server.rs",
        [("    if bound.is_err() {", "    if bound.is_err() && false {")],
        "under CURVE, a key may take an identity (its PeerId, credential and grants) that another key presented first"),
    "mechanism-not-checked": (ZMQ + "zmtp.rs",
        [("    if !named(ours) {", "    if false && !named(ours) {")],
        "a peer greeting with the other mechanism (NULL against CURVE) goes on to the handshake"),
}

# The runner's own check (`--self-test`): a variant that does not compile must be reported as
# an error, never as caught, though cargo fails on it as it does on a caught one.
SELF_TEST = {
    "uncompilable": ("crates/kvx-io/src/lib.rs",
        "pub mod access;",
        "pub mod access;\ncompile_error!(\"a variant that does not build\");",
        "a variant that does not compile (the runner must call it an error)",
        ["-p", "kvx-io", "--lib"]),
}


def self_test():
    MUTANTS.update(SELF_TEST)
    for name in SELF_TEST:
        _, verdict_, _ = run(name)
        if not verdict_.startswith("ERROR"):
            sys.exit(f"mutants self-test: {name} was reported {verdict_!r}, not as an error")
        print(f"mutants self-test: {name}: reported as an error, as it must be")


def restore_leftovers():
    """Puts back the originals a killed run left under target/mutant-originals/."""
    for dirpath, _, files in os.walk(ORIGINALS):
        for f in files:
            saved = os.path.join(dirpath, f)
            path = os.path.join(ROOT, os.path.relpath(saved, ORIGINALS))
            print(f"mutants: restoring {os.path.relpath(path, ROOT)}, left mutated by a run that was stopped")
            os.replace(saved, path)


def mutated(path, change):
    """Writes `change(text)` over `path` (relative to the root), keeping the original under
    ORIGINALS; returns the function that puts it back. The original goes back with a new
    modification time, so cargo rebuilds what the mutated file built."""
    full = os.path.join(ROOT, path)
    original = open(full).read()
    saved = os.path.join(ORIGINALS, path)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    with open(saved, "w") as f:
        f.write(original)
    with open(full, "w") as f:
        f.write(change(original))

    def put_back():
        with open(full, "w") as f:
            f.write(original)
        os.remove(saved)
    return put_back


def apply_all(text, pairs):
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def run_curve(name):
    path, pairs, what = CURVE_MUTANTS[name]
    env = dict(os.environ, KVX_REQUIRE_PYTHON="1", PROPTEST_DISABLE_FAILURE_PERSISTENCE="1")
    cmd = ["cargo", "test", "-q", "--no-fail-fast", "-p", "kvx-transport", "--lib", "--test", "zmq_curve"]
    return verdict(name, what, path, lambda text: apply_all(text, pairs), cmd, env)


def run(name):
    path, old, new, what, *selection = MUTANTS[name]
    selection = selection[0] if selection else PROTO_TESTS
    # The failures a variant makes are its own: proptest must not keep them in the checkout's
    # regression files.
    env = dict(os.environ, PROPTEST_CASES="1000", PROPTEST_DISABLE_FAILURE_PERSISTENCE="1")
    env.pop("KVX_TRACE", None)
    if os.geteuid() == 0:
        # As root the cross-user tests can run, so a variant must not turn them into a skip.
        env["KVX_REQUIRE_CROSS_USER"] = "1"
    cmd = ["cargo", "test", "-q", "--release", "--no-fail-fast"] + selection
    return verdict(name, what, path, lambda text: text.replace(old, new, 1), cmd, env)


def verdict(name, what, path, change, cmd, env):
    put_back = mutated(path, change)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        # A test that hangs under the variant checks it no better than one that passes.
        return name, "ERROR (the tests ran past 900 s: a test waits without a bound)", what
    finally:
        put_back()
    out = proc.stdout + proc.stderr
    # `cargo test -q` lists failing tests indented under a "failures:" heading.
    failed, in_list = [], False
    for line in out.splitlines():
        if line == "failures:":
            in_list = True
        elif in_list and re.fullmatch(r"    [a-z_0-9:]+", line):
            failed.append(line.strip())
        elif in_list and line.startswith("test result"):
            in_list = False
    failed = sorted(set(failed))
    if proc.returncode == 0:
        return name, "MISSED", what
    if not failed:
        # Not one test failed, yet cargo did: a build error, a denied lint, a missing test
        # target, the harness killed... The variant checked nothing.
        errors = [l for l in out.splitlines() if l.startswith("error")] or out.strip().splitlines()[-1:]
        return name, f"ERROR (cargo exit {proc.returncode}, no test failed): {'; '.join(errors[:3])}", what
    return name, "caught by " + ", ".join(failed), what


def main():
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:
        print(__doc__)
        return
    if "--list" in args:
        table = CURVE_MUTANTS if "--curve" in args else MUTANTS
        for name, entry in table.items():
            print(f"{name:28} {entry[3] if table is MUTANTS else entry[2]}")
        return
    if "--self-test" in args:
        restore_leftovers()
        self_test()
        return
    curve = "--curve" in args
    args = [a for a in args if a != "--curve"]
    table, runner = (CURVE_MUTANTS, run_curve) if curve else (MUTANTS, run)
    script = "scripts/mutants.py" + (" --curve" if curve else "")
    # A stop (Ctrl-C, SIGTERM) puts the file under mutation back on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    restore_leftovers()
    names = mutant_selection.select(table, args, script)
    missed = False
    for name in names:
        name, verdict_, what = runner(name)
        missed |= not verdict_.startswith("caught")
        print(f"{name:28} {verdict_}\n{'':28} ({what})", flush=True)
    sys.exit(1 if missed else 0)

if __name__ == "__main__":
    main()
