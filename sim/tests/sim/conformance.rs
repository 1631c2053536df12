//! The same test bodies every `Transport` and `Fabric` implementation runs (`kvx_io::conformance`),
//! here against the simulated ones, so that the simulation proves things about the real
//! system and not only about itself.

use kvx_io::conformance as c;
use kvx_sim::fabric::SimFabric;
use kvx_sim::net::SimTransport;
use kvx_sim::run::with_world;

fn transport(world: &kvx_sim::world::World) -> SimTransport {
    world.node_started("main");
    SimTransport::new(world.clone(), "main")
}

fn fabric(world: &kvx_sim::world::World) -> SimFabric {
    world.node_started("main");
    SimFabric::new(world.clone(), "main")
}

#[test]
fn transport_request_reply() {
    with_world(1, |w| async move {
        c::transport_request_reply(&transport(&w), "server", 64).await
    });
}

#[test]
fn transport_notices() {
    with_world(2, |w| async move {
        c::transport_notices(&transport(&w), "notices", 64).await
    });
}

#[test]
fn fabric_writes_land_in_order() {
    with_world(3, |w| async move {
        c::fabric_writes_land_in_order(&fabric(&w), "buffer", 16, 4096).await
    });
}

#[test]
fn fabric_reset_flushes() {
    with_world(4, |w| async move {
        c::fabric_reset_flushes(&fabric(&w), "buffer").await
    });
}

#[test]
fn fabric_rejects_out_of_bounds() {
    with_world(5, |w| async move {
        c::fabric_rejects_out_of_bounds(&fabric(&w), "buffer").await
    });
}

#[test]
fn fabric_refuses_writes_outside_grants() {
    with_world(7, |w| async move {
        c::fabric_refuses_writes_outside_grants(&fabric(&w), "buffer", true).await
    });
}

#[test]
fn fabric_lands_only_whole_chunks() {
    with_world(9, |w| async move {
        c::fabric_lands_only_whole_chunks(&fabric(&w), "buffer", true).await
    });
}

#[test]
fn fabric_checks_checksums() {
    with_world(8, |w| async move {
        c::fabric_checks_checksums(&fabric(&w), "buffer").await
    });
}

#[test]
fn fabric_runs_land_as_their_pieces() {
    with_world(10, |w| async move {
        c::fabric_runs_land_as_their_pieces(&fabric(&w), "buffer", false).await
    });
}

/// FIFO per connection holds with a wide latency spread (the jitter never reorders).
#[test]
fn transport_stays_fifo_under_jitter() {
    with_world(6, |w| async move {
        w.lock().model.control_latency_max = std::time::Duration::from_millis(5);
        c::transport_request_reply(&transport(&w), "server", 256).await
    });
}

/// A broken connection loses what was in flight and only that: the client hears
/// `Disconnected`, then `Reconnected`, and later messages arrive in order.
#[test]
fn transport_loses_only_on_a_break() {
    use bytes::Bytes;
    use kvx_io::{ClientEvent, Transport};
    with_world(7, |w| async move {
        let t = transport(&w);
        let mut server = t.serve("srv").await.expect("serve");
        let mut client = t.connect("srv", "client").await.expect("connect");
        client
            .send(Bytes::from_static(b"before"))
            .await
            .expect("send");
        let (_, got) = server.recv().await.expect("open");
        assert_eq!(got, Bytes::from_static(b"before"));
        w.disconnect("main", "main");
        assert_eq!(client.recv().await, Some(ClientEvent::Disconnected));
        assert_eq!(client.recv().await, Some(ClientEvent::Reconnected));
        // Not acknowledged yet: dropped even though connected (the fence).
        client
            .send(Bytes::from_static(b"stale"))
            .await
            .expect("send");
        client.send(kvx_io::DISCONNECT_ACK).await.expect("ack");
        for i in 0..10u8 {
            client.send(Bytes::from(vec![i])).await.expect("send");
        }
        for i in 0..10u8 {
            let (_, got) = server.recv().await.expect("open");
            assert_eq!(
                got,
                Bytes::from(vec![i]),
                "FIFO after reconnecting, nothing from before the acknowledgement"
            );
        }
    });
}
