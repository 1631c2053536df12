//! The conformance bodies of the control plane (`Transport`): request and reply between
//! clients and a server, and notices from sinks to a source.

use bytes::Bytes;

use super::step;
use crate::transport::{ClientEvent, Transport};

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

/// Notices from two sinks all arrive, each sink's in order; a 64 KiB payload arrives intact;
/// each sink's notices name one connection, another than the other sink's (the proxy counts
/// a connection as one sender: `kvx_proto::proxy`).
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
    let mut connections = [None; 2];
    let mut got_big = false;
    for _ in 0..2 * n + 1 {
        let notice = step("notice", source.recv_notice())
            .await
            .expect("conformance: source open");
        let payload = notice.payload;
        if payload.len() == big.len() {
            assert_eq!(payload, big, "conformance: large payload intact");
            assert_eq!(
                Some(notice.from.connection),
                connections[0],
                "conformance: a sink's notices name one connection"
            );
            got_big = true;
            continue;
        }
        let text = String::from_utf8(payload.to_vec()).expect("conformance: payload intact");
        let who = usize::from(text.starts_with('b'));
        let connection = *connections[who].get_or_insert(notice.from.connection);
        assert_eq!(
            notice.from.connection, connection,
            "conformance: a sink's notices name one connection"
        );
        assert_eq!(
            text[1..].parse::<usize>().ok(),
            Some(next[who]),
            "conformance: per-sink FIFO"
        );
        next[who] += 1;
    }
    assert!(got_big, "conformance: the large notice arrived");
    assert_ne!(
        connections[0], connections[1],
        "conformance: two sinks are two connections"
    );
}
