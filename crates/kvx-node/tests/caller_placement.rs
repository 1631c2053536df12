//! Caller placement through the drivers (`kvx_node::placement`), over the in-memory transport
//! and fabric: the application lends a request's slots, a real sender fills exactly those
//! slots in chunk order, and the reservation comes back on the application's own stream,
//! consumed or with the reason it was not; and a receive buffer lent in per-layer parts, over
//! ZeroMQ and the TCP fabric.

#![allow(unsafe_code)] // one test lends its own memory (`ExternalRegion::new`) and reads it back

use std::time::Duration;

mod lent;
use lent::Layer;

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;
use kvx_node::synthetic::{self, Decoded, SyntheticRequest};
use kvx_node::{ReceiverAddr, ReceiverNode, ReceiverNotice, Returned, SenderNode};
use kvx_proto::receiver::{Failure, Outcome, PlacementError};
use kvx_proto::{Placement, ReceiverConfig, ReqId, SenderConfig, SlotIndex};

const CHUNK: usize = 4096;

type Env = TokioEnv<MemTransport, MemFabric>;

/// Request `id`'s claim secret, which the synthetic sender carries.
fn secret(id: &str) -> kvx_proto::ClaimSecret {
    synthetic::claim_secret(&ReqId(id.into()))
}

fn slots(list: &[u32]) -> Vec<SlotIndex> {
    list.iter().copied().map(SlotIndex).collect()
}

async fn receiver(
    env: &Env,
    placement: Placement,
) -> kvx_node::ReceiverHandle<kvx_io::LocalMemory> {
    let cfg = ReceiverConfig {
        buffer_slots: 8,
        placement,
        ..ReceiverConfig::default()
    };
    ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts")
}

/// Sender "s0" with 4 staging slots, on `env`, connected to the receiver at `addr`.
async fn sender<E: kvx_io::Env>(
    env: &E,
    addr: ReceiverAddr,
) -> (kvx_node::SenderHandle<E>, kvx_proto::PeerId) {
    let cfg = SenderConfig {
        staging_slots: 4,
        ..SenderConfig::default()
    };
    let sender = SenderNode::start(env.clone(), cfg, CHUNK, "s0".into(), None)
        .await
        .expect("sender starts");
    let peer = sender.add_receiver(addr).await.expect("connects");
    (sender, peer)
}

fn request(peer: kvx_proto::PeerId, id: &str, chunks: u32) -> SyntheticRequest {
    SyntheticRequest {
        req_id: ReqId(id.into()),
        receiver: peer,
        chunks,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    }
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} within 10 s"))
}

/// What `reserve_and_send` leaves running: the receiver, its returns stream and reader, the
/// ready notice, and the sender's task.
struct Sent {
    _rx: kvx_node::ReceiverHandle<kvx_io::LocalMemory>,
    returns: kvx_node::Returns,
    reader: kvx_node::ChunkReader<kvx_io::LocalMemory>,
    ready: kvx_node::ReadyRequest,
    prefill:
        tokio::task::JoinHandle<Result<synthetic::PrefillTiming, kvx_proto::sender::SendFailure>>,
}

/// A caller-placement receiver reserves `reserved` for request `id` (its first `held` chunks
/// held), and a real sender sends all `chunks` of it; returns once the request is ready.
async fn reserve_and_send(id: &str, held: u32, reserved: &[u32], chunks: u32) -> Sent {
    let env = TokioEnv::new(MemTransport::new(), MemFabric::new());
    let mut rx = receiver(&env, Placement::Caller).await;
    let returns = rx.take_returns().expect("the returns stream");
    assert!(rx.take_returns().is_none(), "taken once");
    let reader = rx.reader().clone();
    reader
        .reserve_held(id, held, slots(reserved), secret(id))
        .await
        .expect("reserved");
    let addr = ReceiverAddr {
        alloc: rx.alloc_endpoint().to_owned(),
        fabric: rx.fabric_endpoint().to_owned(),
    };
    let (tx, peer) = sender(&env, addr).await;
    let req = request(peer, id, chunks);
    let prefill = tokio::spawn(async move { synthetic::prefill(&tx, &req).await });
    let ready = match within("the ready notice", rx.next_notice()).await {
        Some(ReceiverNotice::Ready(ready)) => ready,
        Some(ReceiverNotice::Ended { key, outcome }) => panic!("{key} ended: {outcome}"),
        None => panic!("the receiver stopped"),
    };
    Sent {
        _rx: rx,
        returns,
        reader,
        ready,
        prefill,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_fills_the_slots_the_application_reserved_in_chunk_order() {
    let mut sent = reserve_and_send("r", 0, &[6, 1, 4], 3).await;
    assert_eq!(
        sent.ready.slots,
        slots(&[6, 1, 4]),
        "chunk i in the reservation's slot i"
    );
    // Every byte of chunk i is in slot i of the reservation.
    let decoded = synthetic::decode(&sent.reader, sent.ready, CHUNK, true).await;
    assert_eq!(decoded, Decoded::Verified(3 * CHUNK as u64));
    within("the prefill", sent.prefill)
        .await
        .expect("joins")
        .expect("delivered");
    let back = within("the return", sent.returns.recv())
        .await
        .expect("a return");
    assert_eq!(
        back,
        Returned {
            req_id: ReqId("r".into()),
            slots: slots(&[6, 1, 4]),
            outcome: Outcome::Consumed,
        }
    );
}

/// A reservation whose first chunks the application holds already (a local prefix hit): the
/// sender sends all five chunks and is delivered; only chunks 2..5 are written, into the
/// reserved slots in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_the_application_holds_are_not_written() {
    let mut sent = reserve_and_send("h", 2, &[7, 0, 3], 5).await;
    assert_eq!(sent.ready.slots, slots(&[7, 0, 3]), "chunk 2 + i in slot i");
    within("the prefill", sent.prefill)
        .await
        .expect("joins")
        .expect("delivered, the held chunks counted as sent");
    let lease = sent.reader.lease(sent.ready).await.expect("leased");
    for i in 0..3 {
        let mut ok = false;
        lease.inspect_chunk(i, CHUNK, &mut |got| {
            ok = synthetic::chunk_matches("h", 2 + i as u32, got)
        });
        assert!(ok, "slot {i} holds chunk {} byte for byte", 2 + i);
    }
    lease.consume().await.expect("consumed");
    let back = within("the return", sent.returns.recv())
        .await
        .expect("a return");
    assert_eq!(back.slots, slots(&[7, 0, 3]));
    assert_eq!(back.outcome, Outcome::Consumed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawn_reservation_comes_back_and_its_sender_is_told_why() {
    let env = TokioEnv::new(MemTransport::new(), MemFabric::new());
    let mut rx = receiver(&env, Placement::Caller).await;
    let mut returns = rx.take_returns().expect("the returns stream");
    let reader = rx.reader().clone();
    let addr = ReceiverAddr {
        alloc: rx.alloc_endpoint().to_owned(),
        fabric: rx.fabric_endpoint().to_owned(),
    };
    let (tx, peer) = sender(&env, addr).await;
    // The claim comes first and waits for its reservation.
    let req = request(peer, "w", 3);
    let admit = {
        let tx = tx.clone();
        let req = request(peer, "w", 3);
        tokio::spawn(async move { synthetic::admit(&tx, &req).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!admit.is_finished(), "no admission before the reservation");
    reader
        .reserve("w", slots(&[0, 2, 5]), secret("w"))
        .await
        .expect("reserved");
    let waited = within("the admission", admit)
        .await
        .expect("joins")
        .expect("admitted");
    reader.withdraw("w").await.expect("withdrawn");
    let back = within("the return", returns.recv())
        .await
        .expect("a return");
    assert_eq!(back.slots, slots(&[0, 2, 5]));
    assert_eq!(back.outcome, Outcome::Failed(Failure::Withdrawn));
    let failure = within("the transfer", synthetic::transfer(&tx, &req, waited))
        .await
        .expect_err("the withdrawn request fails at the sender");
    assert!(failure.to_string().contains("withdrew"), "{failure}");
    // The id is gone: withdrawing it again is refused with the reason.
    assert_eq!(
        reader.withdraw("w").await,
        Err(PlacementError::Unknown("w".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_are_refused_by_a_pool_receiver_and_by_a_stopped_one() {
    let env = TokioEnv::new(MemTransport::new(), MemFabric::new());
    let pool = receiver(&env, Placement::Pool).await;
    assert_eq!(
        pool.reader().reserve("r", slots(&[0]), secret("r")).await,
        Err(PlacementError::NotCaller)
    );
    let env = TokioEnv::new(MemTransport::new(), MemFabric::new());
    let caller = receiver(&env, Placement::Caller).await;
    let reader = caller.reader().clone();
    reader.shutdown().await;
    let stopped = within("a stopped driver's answer", async {
        loop {
            match reader.reserve("r", slots(&[0]), secret("r")).await {
                Err(PlacementError::Stopped) => break,
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    stopped.await;
    assert_eq!(reader.withdraw("r").await, Err(PlacementError::Stopped));
}

/// A receive buffer lent as separate ranges of the same size (one per model layer, as a
/// vLLM decode engine's per-layer KV tensors are), over ZeroMQ and the TCP fabric on
/// loopback: the reservation names slots across the parts (slot `layer × blocks + block`),
/// and each chunk's bytes land in its own layer's range, nowhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_land_in_the_layer_ranges_of_a_buffer_lent_in_parts() {
    use kvx_transport::tcp_fabric::TcpFabric;
    use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

    const BLOCKS: usize = 4;
    let layers: Vec<std::sync::Arc<Layer>> =
        (0..2).map(|_| Layer::zeroed(BLOCKS * CHUNK)).collect();
    // The test reads the layers (below) only after their request was consumed and returned.
    let region = lent::region(&layers, CHUNK);
    let env = TokioEnv::new(
        ZmqTransport::new(ZmqConfig::default()).expect("ZMQ"),
        TcpFabric::new(),
    );
    let cfg = ReceiverConfig {
        buffer_slots: 2 * BLOCKS as u32,
        placement: Placement::Caller,
        ..ReceiverConfig::default()
    };
    let mut rx =
        ReceiverNode::start_in(env.clone(), cfg, region, "tcp://127.0.0.1:0", "127.0.0.1:0")
            .await
            .expect("receiver starts");
    let mut returns = rx.take_returns().expect("the returns stream");
    let reader = rx.reader().clone();
    // Block 2 of layer 1, then block 2 of layer 0.
    reader
        .reserve("r", slots(&[6, 2]), secret("r"))
        .await
        .expect("reserved");
    let addr = ReceiverAddr {
        alloc: rx.alloc_endpoint().to_owned(),
        fabric: rx.fabric_endpoint().to_owned(),
    };
    let (tx, peer) = sender(&env, addr).await;
    let req = request(peer, "r", 2);
    let prefill = tokio::spawn(async move { synthetic::prefill(&tx, &req).await });
    let ready = match within("the ready notice", rx.next_notice()).await {
        Some(ReceiverNotice::Ready(ready)) => ready,
        other => panic!("expected the ready notice, got {other:?}"),
    };
    assert_eq!(
        synthetic::decode(&reader, ready, CHUNK, true).await,
        Decoded::Verified(2 * CHUNK as u64)
    );
    within("the prefill", prefill)
        .await
        .expect("joins")
        .expect("delivered");
    let back = within("the return", returns.recv())
        .await
        .expect("a return");
    assert_eq!(
        (back.slots, back.outcome),
        (slots(&[6, 2]), Outcome::Consumed)
    );
    // SAFETY: nothing writes the layers any more (the request was consumed and its slots
    // returned), and the test keeps them.
    let layer = |l: usize| unsafe { std::slice::from_raw_parts(layers[l].at(0), layers[l].len()) };
    let mut expected = vec![0u8; CHUNK];
    for (chunk, (l, block)) in [(1usize, 2usize), (0, 2)].into_iter().enumerate() {
        synthetic::chunk_bytes("r", chunk as u32, &mut expected);
        assert_eq!(
            &layer(l)[block * CHUNK..(block + 1) * CHUNK],
            &expected[..],
            "chunk {chunk}"
        );
    }
    for (l, block) in [(0, 0), (0, 1), (0, 3), (1, 0), (1, 1), (1, 3)] {
        assert!(
            layer(l)[block * CHUNK..(block + 1) * CHUNK]
                .iter()
                .all(|&b| b == 0),
            "layer {l} block {block} was never lent"
        );
    }
}
