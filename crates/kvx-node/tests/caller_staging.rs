//! Caller staging through the drivers (`docs/spec/protocol.md` §Caller staging): a sender
//! whose staging is the application's own memory, lent in per-layer parts
//! (`SenderNode::start_in` over an `ExternalRegion::join`), sends chunks straight from the
//! slots each batch names — two requests reading one slot, as requests sharing a prefix block
//! do — with nothing allocated; every byte lands as written, and `released` tells the
//! application when a request reads none of its memory any more.

#![allow(unsafe_code)] // the test lends its own memory (`tests/lent`) and fills it

use std::sync::Arc;
use std::time::Duration;

mod lent;
use lent::Layer;

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;
use kvx_node::synthetic;
use kvx_node::{ReceiverAddr, ReceiverNode, ReceiverNotice, SenderHandle, SenderNode};
use kvx_proto::sender::{ChunkSpec, RequestSpec, SendError};
use kvx_proto::{Placement, ReceiverConfig, ReqId, SenderConfig, StagingSlot};

const CHUNK: usize = 4096;
/// Slots per layer of the lent staging: two layers of 4 blocks.
const BLOCKS: usize = 4;

type Env = TokioEnv<MemTransport, MemFabric>;

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} within 10 s"))
}

/// A receiver of 8 slots and a caller-staging sender over two lent layers of `BLOCKS` slots,
/// each slot filled with `synthetic::chunk_bytes("slot{s}", 0)` before anything is sent.
async fn pair(
    env: &Env,
) -> (
    kvx_node::ReceiverHandle<kvx_io::LocalMemory>,
    SenderHandle<Env>,
    kvx_proto::PeerId,
    Vec<Arc<Layer>>,
) {
    let cfg = ReceiverConfig {
        buffer_slots: 8,
        peer_share_percent: 100,
        ..ReceiverConfig::default()
    };
    let rx = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "buffer")
        .await
        .expect("receiver starts");
    let layers = filled_layers();
    // Nothing writes the layers while kvx uses them.
    let region = lent::region(&layers, CHUNK);
    let cfg = SenderConfig {
        staging_slots: 2 * BLOCKS as u32,
        staging_placement: Placement::Caller,
        ..SenderConfig::default()
    };
    let tx = SenderNode::start_in(env.clone(), cfg, region, "s0".into(), None)
        .await
        .expect("sender starts");
    let addr = ReceiverAddr {
        alloc: rx.alloc_endpoint().to_owned(),
        fabric: rx.fabric_endpoint().to_owned(),
    };
    let peer = tx.add_receiver(addr).await.expect("connects");
    (rx, tx, peer, layers)
}

/// Two lent layers of `BLOCKS` slots, slot `s` filled with `synthetic::chunk_bytes("slot{s}",
/// 0)`.
fn filled_layers() -> Vec<Arc<Layer>> {
    let layers: Vec<Arc<Layer>> = (0..2).map(|_| Layer::zeroed(BLOCKS * CHUNK)).collect();
    for (l, layer) in layers.iter().enumerate() {
        for b in 0..BLOCKS {
            let mut bytes = vec![0; CHUNK];
            synthetic::chunk_bytes(&format!("slot{}", l * BLOCKS + b), 0, &mut bytes);
            for (i, byte) in bytes.into_iter().enumerate() {
                // SAFETY: nothing else reaches the layer yet.
                unsafe { *layer.at(b * CHUNK + i) = byte };
            }
        }
    }
    layers
}

/// Leases `ready`, checks that chunk i holds staging slot `staging[i]`'s bytes
/// (`filled_layers`), and consumes it.
async fn consume_checked(
    reader: &kvx_node::ChunkReader<kvx_io::LocalMemory>,
    ready: kvx_node::ReadyRequest,
    staging: &[u32],
) {
    let key = ready.key.clone();
    let lease = reader.lease(ready).await.expect("leased");
    for (chunk, s) in staging.iter().enumerate() {
        let mut want = vec![0; CHUNK];
        synthetic::chunk_bytes(&format!("slot{s}"), 0, &mut want);
        let mut got = Vec::new();
        lease.inspect_chunk(chunk, CHUNK, &mut |b| got = b.to_vec());
        assert!(
            got == want,
            "{key} chunk {chunk}: not staging slot {s}'s bytes"
        );
    }
    lease.consume().await.expect("consumed");
}

fn spec(peer: kvx_proto::PeerId, id: &str, chunks: u32) -> RequestSpec {
    RequestSpec {
        req_id: ReqId(id.into()),
        receiver: peer,
        total_chunks: chunks,
        fmt: 1,
        shape: vec![1],
        dtype: "bf16".into(),
        claim: Some(synthetic_secret(id)),
    }
}

/// Request `id`'s claim secret, as its reservation was made with.
fn synthetic_secret(id: &str) -> kvx_proto::ClaimSecret {
    synthetic::claim_secret(&ReqId(id.into()))
}

/// Submits `req`'s chunks read from `slots`, in one batch, after marking each slot staged
/// (its checksum taken where the bytes are).
fn submit<E: kvx_io::Env>(tx: &SenderHandle<E>, req: &str, slots: &[u32]) {
    let chunks = slots
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            tx.staged(StagingSlot(s), CHUNK);
            ChunkSpec {
                key: format!("{req}@{i}"),
                staging: StagingSlot(s),
                tokens: 1,
                bytes: 0,
            }
        })
        .collect();
    tx.submit(&ReqId(req.into()), chunks, true)
        .expect("submitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_send_straight_from_the_slots_they_name_one_of_them_shared() {
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (mut rx, tx, peer, _layers) = pair(&env).await;
    for (id, n) in [("a", 2), ("b", 2)] {
        tx.begin(spec(peer, id, n)).expect("begins");
        within("admission", tx.admitted(&ReqId(id.into())))
            .await
            .expect("admitted");
    }
    // Slot 5 (layer 1, block 1) is read by both at once.
    submit(&tx, "a", &[0, 5]);
    submit(&tx, "b", &[5, 7]);
    for id in ["a", "b"] {
        within("release", tx.released(&ReqId(id.into())))
            .await
            .expect("delivered");
    }
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match within("a ready notice", rx.next_notice()).await {
            Some(ReceiverNotice::Ready(ready)) => {
                let slots: Vec<u32> = match ready.key.req_id.0.as_str() {
                    "a" => vec![0, 5],
                    _ => vec![5, 7],
                };
                seen.push(ready.key.req_id.0.clone());
                consume_checked(rx.reader(), ready, &slots).await;
            }
            Some(ReceiverNotice::Ended { .. }) => {}
            None => panic!("the receiver stopped"),
        }
    }
    seen.sort();
    assert_eq!(seen, ["a", "b"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_allocated_from_the_callers_staging() {
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (_rx, tx, peer, _layers) = pair(&env).await;
    tx.begin(spec(peer, "a", 1)).expect("begins");
    within("admission", tx.admitted(&ReqId("a".into())))
        .await
        .expect("admitted");
    let refused = tx.allocate(&ReqId("a".into()), &mut Vec::new()).await;
    assert!(
        matches!(&refused, Err(SendError::Misuse { why, .. }) if why.contains("staging_placement = caller")),
        "{refused:?}"
    );
}

/// A cancelled request is released once nothing of it reads the caller's memory: its
/// outcome (cancelled) comes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_is_released_with_its_failure() {
    let env = Env::new(MemTransport::new(), MemFabric::new());
    let (_rx, tx, peer, _layers) = pair(&env).await;
    tx.begin(spec(peer, "a", 2)).expect("begins");
    within("admission", tx.admitted(&ReqId("a".into())))
        .await
        .expect("admitted");
    let chunk = ChunkSpec {
        key: "a@0".into(),
        staging: StagingSlot(3),
        tokens: 1,
        bytes: 0,
    };
    tx.staged(StagingSlot(3), CHUNK);
    tx.submit(&ReqId("a".into()), vec![chunk], false)
        .expect("submitted");
    tx.cancel(&ReqId("a".into())).expect("cancelled");
    let released = within("release", tx.released(&ReqId("a".into()))).await;
    assert!(released.is_err(), "{released:?}");
}

/// Over the TCP fabric, chunks whose staging slots and reserved receiver slots are both
/// consecutive go as one write (`kvx_io::WriteRun`), as a run of a layer's KV blocks does:
/// four such chunks are one write, and three whose receiver slots break after the second are
/// two; every byte lands where it was reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_chunks_go_as_one_write_over_tcp() {
    use kvx_node::WriteCounts;
    use kvx_proto::SlotIndex;
    use kvx_transport::tcp_fabric::TcpFabric;
    use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

    let env = TokioEnv::new(
        ZmqTransport::new(ZmqConfig::default()).expect("ZMQ"),
        TcpFabric::new(),
    );
    let cfg = ReceiverConfig {
        buffer_slots: 8,
        placement: Placement::Caller,
        ..ReceiverConfig::default()
    };
    let mut rx = ReceiverNode::start(env.clone(), cfg, CHUNK, "tcp://127.0.0.1:0", "127.0.0.1:0")
        .await
        .expect("receiver starts");
    let reader = rx.reader().clone();
    let reserved: [(&str, &[u32], &[u32]); 2] = [
        // (request, staging slots, reserved receiver slots)
        ("run", &[0, 1, 2, 3], &[4, 5, 6, 7]),
        ("split", &[4, 5, 6], &[0, 1, 3]),
    ];
    for (id, _, remote) in reserved {
        let remote = remote.iter().copied().map(SlotIndex).collect();
        reader
            .reserve(id, remote, synthetic_secret(id))
            .await
            .expect("reserved");
    }
    let layers = filled_layers();
    let cfg = SenderConfig {
        staging_slots: 2 * BLOCKS as u32,
        staging_placement: Placement::Caller,
        ..SenderConfig::default()
    };
    let region = lent::region(&layers, CHUNK);
    let tx = SenderNode::start_in(env.clone(), cfg, region, "s0".into(), None)
        .await
        .expect("sender starts");
    let addr = ReceiverAddr {
        alloc: rx.alloc_endpoint().to_owned(),
        fabric: rx.fabric_endpoint().to_owned(),
    };
    let peer = tx.add_receiver(addr).await.expect("connects");
    for (id, staging, _) in reserved {
        tx.begin(spec(peer, id, staging.len() as u32))
            .expect("begins");
        within("admission", tx.admitted(&ReqId(id.into())))
            .await
            .expect("admitted");
        submit(&tx, id, staging);
        within("release", tx.released(&ReqId(id.into())))
            .await
            .expect("delivered");
    }
    assert_eq!(
        tx.write_counts(),
        WriteCounts {
            writes: 1 + 2,
            bytes: 7 * CHUNK as u64
        },
        "one write for the run of four, two for the three"
    );
    for _ in 0..2 {
        let Some(ReceiverNotice::Ready(ready)) = within("a ready notice", rx.next_notice()).await
        else {
            panic!("a ready notice");
        };
        let (_, staging, _) = reserved
            .iter()
            .find(|(id, ..)| *id == ready.key.req_id.0)
            .expect("one of ours");
        consume_checked(&reader, ready, staging).await;
    }
}
