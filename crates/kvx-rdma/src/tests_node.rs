//! The kvx drivers (`kvx-node`) over `RdmaFabric` on the NIC model: a work request that fails
//! mid-request fails that request cleanly — the sender's caller gets an error, the receiver
//! ends the request, the proxy hears of the failure — and once the driver has replaced the
//! connection, requests go through on a new queue pair.

use std::time::Duration;

use kvx_io::mem::MemTransport;
use kvx_io::TokioEnv;
use kvx_node::synthetic::{self, Decoded, SyntheticRequest};
use kvx_node::{ProxyNode, ReceiverAddr, ReceiverNode, ReceiverNotice, SenderNode};
use kvx_proto::receiver::Outcome;
use kvx_proto::{ProxyConfig, ReceiverConfig, ReqId, SenderConfig};
use tokio::sync::mpsc;

use crate::fake::FakeVerbs;
use crate::{RdmaConfig, RdmaFabric};

const CHUNK: usize = 4096;
const STEP: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_fails_its_request_everywhere_and_the_next_one_reconnects() {
    let verbs = FakeVerbs::new();
    let fabric = RdmaFabric::with_verbs(verbs.clone(), RdmaConfig::default()).expect("fabric");
    let env = TokioEnv::new(MemTransport::new(), fabric);
    let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
        .await
        .expect("proxy");
    // RDMA carries no checksum of kvx's (`docs/operations.md`): the receiver must not
    // require one, and the sender need not compute it.
    let cfg = ReceiverConfig {
        buffer_slots: 16,
        require_checksums: false,
        ..ReceiverConfig::default()
    };
    let mut receiver = ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "127.0.0.1:0")
        .await
        .expect("receiver");
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    // The decoder: verifies and consumes ready requests, reports every request's end.
    let (ended_tx, mut ended) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(notice) = receiver.next_notice().await {
            match notice {
                ReceiverNotice::Ready(ready) => {
                    let d = synthetic::decode(receiver.reader(), &ready, CHUNK, true).await;
                    assert!(matches!(d, Decoded::Verified(_)), "{d:?}");
                }
                ReceiverNotice::Ended { key, outcome } => {
                    let _ = ended_tx.send((key.req_id, outcome));
                }
            }
        }
    });
    let sender_cfg = SenderConfig {
        staging_slots: 4,
        notify_proxy_on_failure: true,
        checksums: false,
        ..SenderConfig::default()
    };
    let sender = SenderNode::start(
        env.clone(),
        sender_cfg,
        CHUNK,
        "s0".into(),
        Some(proxy.endpoint().into()),
    )
    .await
    .expect("sender");
    let peer = sender.add_receiver(addr).await.expect("connects");
    let request = |id: &str| SyntheticRequest {
        req_id: ReqId(id.into()),
        receiver: peer,
        chunks: 8,
        batch_chunks: 2,
        chunk_bytes: CHUNK,
    };

    // The fourth write of "broken" fails like a link going down.
    verbs.fail_write_after(3);
    let broken = request("broken");
    let verdict = proxy
        .expect(broken.req_id.clone(), 1)
        .await
        .expect("fresh id");
    let failed = tokio::time::timeout(STEP, synthetic::prefill(&sender, &broken))
        .await
        .expect("bounded");
    assert!(
        failed.is_err(),
        "the caller hears of the failure: {failed:?}"
    );
    let proxy_says = tokio::time::timeout(STEP, verdict)
        .await
        .expect("bounded")
        .expect("answered");
    assert!(proxy_says.is_err(), "the proxy hears of the failure");
    let (id, outcome) = tokio::time::timeout(STEP, ended.recv())
        .await
        .expect("bounded")
        .expect("receiver running");
    assert_eq!(id, broken.req_id);
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");

    // The failed connection is replaced (in the background; meanwhile a request fails with
    // "no fabric connection"): then a request completes, byte for byte.
    let mut attempt = 0;
    let fine = loop {
        attempt += 1;
        let fine = request(&format!("fine-{attempt}"));
        let verdict = proxy
            .expect(fine.req_id.clone(), 1)
            .await
            .expect("fresh id");
        let sent = tokio::time::timeout(STEP, synthetic::prefill(&sender, &fine))
            .await
            .expect("bounded");
        match sent {
            Ok(_) => {
                let proxy_says = tokio::time::timeout(STEP, verdict)
                    .await
                    .expect("bounded")
                    .expect("answered");
                assert!(proxy_says.is_ok(), "{proxy_says:?}");
                break fine;
            }
            Err(e) => {
                assert!(attempt < 50, "no new connection after {attempt} tries: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let consumed = tokio::time::timeout(STEP, async {
        while let Some((id, outcome)) = ended.recv().await {
            if id == fine.req_id {
                return outcome;
            }
        }
        panic!("the receiver stopped");
    })
    .await
    .expect("bounded");
    assert_eq!(consumed, Outcome::Consumed);
}
