//! The conformance suite: test bodies that every `Transport` and `Fabric` implementation runs
//! in its own tests (in-memory here; ZMQ, TCP and shared memory in `kvx-transport`; the
//! simulated ones in `sim/`; RDMA where hardware exists). Each body panics with a message
//! naming the broken rule. Every wait is bounded by `STEP_TIMEOUT`.
//!
//! Endpoints are passed in, because their form is transport-specific; a port of 0 is fine:
//! the bodies connect to `local_endpoint()`.

use std::time::Duration;

use bytes::Bytes;
use kvx_proto::{SlotIndex, StagingSlot, WriteId};

use crate::fabric::{Completion, Fabric, FabricError, PostWrite, SlotMemory};
use crate::transport::{ClientEvent, Transport};

/// The longest any single step of a conformance body may take.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

async fn step<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(STEP_TIMEOUT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("conformance: {what} did not happen within {STEP_TIMEOUT:?}"),
    }
}

async fn next_message(client: &mut crate::transport::ControlClient, what: &str) -> Bytes {
    loop {
        match step(what, client.recv()).await {
            Some(ClientEvent::Message(b)) => return b,
            // The contract: one acknowledgement per disconnect, or everything after is dropped.
            Some(ClientEvent::Disconnected) => {
                let _ = client.send(crate::transport::DISCONNECT_ACK).await;
            }
            Some(ClientEvent::Reconnected) => continue,
            None => panic!("conformance: transport closed while waiting for {what}"),
        }
    }
}

/// Two clients send `n` messages each; the server sees each client's messages in order and
/// under one stable peer id per client, and each client receives exactly its own replies, in
/// order.
pub async fn transport_request_reply<T: Transport>(t: &T, server_endpoint: &str, n: usize) {
    let mut server = t.serve(server_endpoint).await.expect("conformance: serve");
    let endpoint = server.local_endpoint().to_owned();
    let mut a = t
        .connect(&endpoint, "conformance-a")
        .await
        .expect("conformance: connect a");
    let mut b = t
        .connect(&endpoint, "conformance-b")
        .await
        .expect("conformance: connect b");
    for i in 0..n {
        a.send(Bytes::from(format!("a{i}")))
            .await
            .expect("conformance: send a");
        b.send(Bytes::from(format!("b{i}")))
            .await
            .expect("conformance: send b");
    }
    let mut seen = std::collections::HashMap::new();
    let mut next = [0usize; 2];
    for _ in 0..2 * n {
        let (peer, payload) = step("server receive", server.recv())
            .await
            .expect("conformance: server open");
        let text = String::from_utf8(payload.to_vec()).expect("conformance: payload intact");
        let who = usize::from(text.starts_with('b'));
        assert_eq!(
            text[1..].parse::<usize>().ok(),
            Some(next[who]),
            "conformance: per-client FIFO"
        );
        next[who] += 1;
        let first = *seen.entry(who).or_insert(peer);
        assert_eq!(first, peer, "conformance: one peer id per client");
        server
            .send(peer, Bytes::from(format!("re:{text}")))
            .await
            .expect("conformance: reply");
    }
    assert_ne!(
        seen[&0], seen[&1],
        "conformance: distinct clients get distinct peer ids"
    );
    for i in 0..n {
        assert_eq!(
            next_message(&mut a, "reply to a").await,
            Bytes::from(format!("re:a{i}"))
        );
        assert_eq!(
            next_message(&mut b, "reply to b").await,
            Bytes::from(format!("re:b{i}"))
        );
    }
}

/// Notices from two sinks all arrive, each sink's in order; a 64 KiB payload arrives intact.
pub async fn transport_notices<T: Transport>(t: &T, source_endpoint: &str, n: usize) {
    let mut source = t
        .notify_source(source_endpoint)
        .await
        .expect("conformance: bind notices");
    let endpoint = source.local_endpoint().to_owned();
    let a = t.notify_sink(&endpoint).await.expect("conformance: sink a");
    let b = t.notify_sink(&endpoint).await.expect("conformance: sink b");
    let big = Bytes::from(vec![0xAB; 64 * 1024]);
    for i in 0..n {
        a.send(Bytes::from(format!("a{i}")))
            .await
            .expect("conformance: notify a");
        b.send(Bytes::from(format!("b{i}")))
            .await
            .expect("conformance: notify b");
    }
    a.send(big.clone()).await.expect("conformance: notify big");
    let mut next = [0usize; 2];
    let mut got_big = false;
    for _ in 0..2 * n + 1 {
        let payload = step("notice", source.recv())
            .await
            .expect("conformance: source open");
        if payload.len() == big.len() {
            assert_eq!(payload, big, "conformance: large payload intact");
            got_big = true;
            continue;
        }
        let text = String::from_utf8(payload.to_vec()).expect("conformance: payload intact");
        let who = usize::from(text.starts_with('b'));
        assert_eq!(
            text[1..].parse::<usize>().ok(),
            Some(next[who]),
            "conformance: per-sink FIFO"
        );
        next[who] += 1;
    }
    assert!(got_big, "conformance: the large notice arrived");
}

fn pattern(slot: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(slot * 7) as u8)
        .collect()
}

async fn next_completion(conn: &mut crate::fabric::FabricConn, what: &str) -> Completion {
    step(what, conn.next_completion())
        .await
        .expect("conformance: connection open")
}

/// Writes land byte for byte, completions come back in posting order, each write that
/// carries an immediate is announced on the receiver with that immediate, and one without
/// is not.
pub async fn fabric_writes_land_in_order<F: Fabric>(
    f: &F,
    endpoint: &str,
    slots: u32,
    slot_bytes: usize,
) {
    let mut listener = f
        .expose(endpoint, slots, slot_bytes)
        .await
        .expect("conformance: expose");
    let staging = f
        .allocate_staging(slots, slot_bytes)
        .expect("conformance: staging");
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone())
        .await
        .expect("conformance: connect");
    for s in 0..slots {
        staging.write_slot(s, &pattern(s, slot_bytes));
    }
    // Staging slot s goes to remote slot (slots-1-s); the first write carries no immediate.
    for s in 0..slots {
        let imm = (s > 0).then_some(1000 + s);
        let w = PostWrite {
            id: WriteId(u64::from(s)),
            local: StagingSlot(s),
            remote: SlotIndex(slots - 1 - s),
            len: slot_bytes,
            imm,
        };
        conn.post(w).expect("conformance: post");
    }
    for s in 0..slots {
        let c = next_completion(&mut conn, "write completion").await;
        assert_eq!(
            c.id,
            WriteId(u64::from(s)),
            "conformance: completions in posting order"
        );
        assert_eq!(c.result, Ok(()), "conformance: write {s} succeeds");
    }
    for s in 1..slots {
        let landed = step("landed notice", listener.landed.recv())
            .await
            .expect("conformance: listener open");
        assert_eq!(
            landed.imm,
            1000 + s,
            "conformance: one notice per immediate, in order, none for a write without"
        );
    }
    let mut got = vec![0u8; slot_bytes];
    for s in 0..slots {
        listener.memory.read_slot(slots - 1 - s, &mut got);
        assert!(
            got == pattern(s, slot_bytes),
            "conformance: slot {} holds staging slot {s}'s bytes",
            slots - 1 - s
        );
    }
}

/// After `reset`, every write still outstanding or posted later completes with an error,
/// exactly once, in order; nothing is lost and nothing completes twice.
pub async fn fabric_reset_flushes<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f
        .expose(endpoint, 4, 4096)
        .await
        .expect("conformance: expose");
    let staging = f.allocate_staging(4, 4096).expect("conformance: staging");
    let mut conn = f
        .connect(&listener.local_endpoint, staging)
        .await
        .expect("conformance: connect");
    let write = |i: u64| PostWrite {
        id: WriteId(i),
        local: StagingSlot((i % 4) as u32),
        remote: SlotIndex((i % 4) as u32),
        len: 4096,
        imm: None,
    };
    for i in 0..4 {
        conn.post(write(i)).expect("conformance: post");
    }
    conn.reset();
    for i in 4..8 {
        // A closed connection may refuse the post; then that write never existed.
        if conn.post(write(i)).is_err() {
            break;
        }
    }
    let mut last = None;
    let mut flushed_seen = false;
    while let Ok(Some(c)) = tokio::time::timeout(STEP_TIMEOUT, conn.next_completion()).await {
        assert!(
            last.is_none_or(|l| c.id > l),
            "conformance: completions in order, none twice"
        );
        last = Some(c.id);
        match c.result {
            Ok(()) => assert!(!flushed_seen, "conformance: no success after a flush"),
            Err(_) => flushed_seen = true,
        }
        if c.id == WriteId(7) {
            break;
        }
    }
    assert!(
        flushed_seen,
        "conformance: writes after a reset are flushed with an error"
    );
}

/// A write outside the registered memory completes with an error; it does not panic or
/// corrupt anything.
pub async fn fabric_rejects_out_of_bounds<F: Fabric>(f: &F, endpoint: &str) {
    let listener = f
        .expose(endpoint, 2, 1024)
        .await
        .expect("conformance: expose");
    let staging = f.allocate_staging(2, 1024).expect("conformance: staging");
    let mut conn = f
        .connect(&listener.local_endpoint, staging)
        .await
        .expect("conformance: connect");
    let w = PostWrite {
        id: WriteId(1),
        local: StagingSlot(0),
        remote: SlotIndex(2),
        len: 1024,
        imm: None,
    };
    match conn.post(w) {
        Err(_) => {}
        Ok(()) => {
            let c = next_completion(&mut conn, "out-of-bounds completion").await;
            assert!(
                matches!(c.result, Err(FabricError::OutOfBounds(..))),
                "conformance: {c:?}"
            );
        }
    }
}
