//! Epochs in the handshake (`docs/spec/protocol.md` §Restarts and epochs): each transport
//! announces its own to every kvx peer, so a restarted process is known for a new
//! incarnation at either end, and a reconnect of the same process is not. Loopback; every
//! wait bounded.

use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::{ClientEvent, ControlClient, Inbound, DISCONNECT_ACK};
use kvx_io::Transport;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

mod zmq_common;
use zmq_common::{quick, serve_again, step};

fn transport() -> ZmqTransport {
    zmq_common::transport(ZmqConfig {
        reconnect_backoff_max: Duration::from_millis(100),
        ..quick()
    })
}

async fn said(client: &mut ControlClient, want: ClientEvent) {
    assert_eq!(step("an event", client.recv()).await, Some(want));
}

#[test]
fn every_transport_draws_its_own_epoch() {
    let epochs: std::collections::HashSet<u64> = (0..16).map(|_| transport().epoch()).collect();
    assert_eq!(epochs.len(), 16);
}

/// A receiver restarted on its port (a new transport: a new process) is a restart to the
/// sender; the same transport serving again (a new socket of the same process) is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dealer_tells_a_restarted_receiver_from_a_reconnect() {
    let first = transport();
    let server = first.serve("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = server.local_endpoint().to_owned();
    let tc = transport();
    let mut client = tc.connect(&endpoint, "epoch-s").await.expect("connect");

    // The same process binds again: a reconnect, no restart.
    drop(server);
    said(&mut client, ClientEvent::Disconnected).await;
    client.send(DISCONNECT_ACK).await.expect("ack");
    let again = serve_again(&first, &endpoint).await;
    said(&mut client, ClientEvent::Reconnected).await;
    assert_eq!(tc.stats().peer_restarts, 0);

    // Another process on the port: a restart.
    drop(again);
    said(&mut client, ClientEvent::Disconnected).await;
    client.send(DISCONNECT_ACK).await.expect("ack");
    let second = transport();
    let _server = serve_again(&second, &endpoint).await;
    said(&mut client, ClientEvent::Reconnected).await;
    assert_eq!(tc.stats().peer_restarts, 1);
}

/// A sender identity that comes back from a new process is a restart to the receiver, and
/// its old incarnation was lost before the new one's first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_tells_a_restarted_sender_under_the_same_identity() {
    let ts = transport();
    let mut server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = server.local_endpoint().to_owned();
    let old = transport();
    let client = old
        .connect(&endpoint, "same-identity")
        .await
        .expect("connect");
    client.send(Bytes::from_static(b"old")).await.expect("send");
    let Some(Inbound::Message(peer, _)) = step("old", server.next()).await else {
        panic!("no message");
    };
    drop(client);
    drop(old);
    assert_eq!(step("lost", server.next()).await, Some(Inbound::Lost(peer)));
    assert_eq!(ts.stats().peer_restarts, 0);

    let new = transport();
    let client = new
        .connect(&endpoint, "same-identity")
        .await
        .expect("connect");
    client.send(Bytes::from_static(b"new")).await.expect("send");
    assert_eq!(
        step("new", server.next()).await,
        Some(Inbound::Message(peer, Bytes::from_static(b"new")))
    );
    assert_eq!(ts.stats().peer_restarts, 1);
}
