//! The kvx drivers (`kvx-node`) over `RdmaFabric` on the NIC model, with chunk checksums on
//! (the core's defaults: the sender computes them, the receiver requires them): a work request
//! that fails mid-request fails that request cleanly — the sender's caller gets an error, the
//! receiver ends the request, the proxy hears of the failure — and once the driver has
//! replaced the connection, requests go through on a new queue pair; a byte that changes after
//! its write landed fails its request at the receiver with a checksum mismatch, and the
//! decoder never sees it. Buffers lent the way kvx's vLLM connector lends its host buffer
//! (per-layer views of one allocation) are registered once and carry a whole request.

use std::sync::Arc;
use std::time::Duration;

use kvx_io::mem::MemTransport;
use kvx_io::TokioEnv;
use kvx_node::synthetic::{self, Decoded, SyntheticRequest};
use kvx_node::{ProxyHandle, ProxyNode, ReceiverAddr, ReceiverNode, ReceiverNotice, SenderNode};
use kvx_proto::receiver::{Failure, Outcome};
use kvx_proto::{PeerId, ProxyConfig, ReceiverConfig, ReqId, SenderConfig};
use tokio::sync::mpsc;

use crate::fake::FakeVerbs;
use crate::{RdmaConfig, RdmaFabric};

const CHUNK: usize = 4096;
const STEP: Duration = Duration::from_secs(20);

type Env = TokioEnv<MemTransport, RdmaFabric<FakeVerbs>>;

/// A proxy, a receiver whose decoder verifies every ready request byte for byte, and a
/// sender attached to it, all with the core's default checksums.
struct Rig {
    verbs: FakeVerbs,
    proxy: ProxyHandle,
    sender: kvx_node::SenderHandle<Env>,
    peer: PeerId,
    /// Every request's end at the receiver.
    ended: mpsc::UnboundedReceiver<(ReqId, Outcome)>,
    /// Every request the decoder was handed as ready.
    ready: mpsc::UnboundedReceiver<ReqId>,
}

/// Memory lent by the test: one allocation, freed when the last region over it is dropped.
struct Backing(*mut [u8]);

// SAFETY: the bytes are reached only through the regions' slots, under kvx's rules.
#[allow(unsafe_code)]
unsafe impl Send for Backing {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Backing {}

impl Drop for Backing {
    #[allow(unsafe_code)] // frees the test's own allocation
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `Box::into_raw` and no region uses it any more.
        drop(unsafe { Box::from_raw(self.0) });
    }
}

/// `layers × slots_per_layer` slots of `CHUNK` bytes as the vLLM connector lends a host
/// buffer: one allocation, one part per layer, the parts end to end.
#[allow(unsafe_code)] // the test lends its own memory (`ExternalRegion::new`)
fn lent_as_layers(layers: usize, slots_per_layer: usize) -> kvx_io::ExternalRegion {
    let layer_bytes = slots_per_layer * CHUNK;
    let raw = Box::into_raw(vec![0u8; layers * layer_bytes].into_boxed_slice());
    let ptr = raw.cast::<u8>();
    let backing = Arc::new(Backing(raw));
    let parts = (0..layers)
        .map(|i| {
            // SAFETY: layer i's bytes of the allocation, kept by `backing` as long as the
            // region lives; the parts do not overlap.
            unsafe {
                kvx_io::ExternalRegion::new(
                    ptr.add(i * layer_bytes),
                    layer_bytes,
                    CHUNK,
                    Box::new(backing.clone()),
                )
            }
            .expect("a layer")
        })
        .collect();
    let joined = kvx_io::ExternalRegion::join(parts).expect("equal layers");
    assert_eq!(
        joined.parts(),
        1,
        "views of one allocation, in order, are one range"
    );
    joined
}

impl Rig {
    async fn start() -> Rig {
        Self::start_with(false).await
    }

    /// `lent`: the receiver's buffer and the sender's staging lent as per-layer views of
    /// one allocation each (`lent_as_layers`).
    async fn start_with(lent: bool) -> Rig {
        let verbs = FakeVerbs::new();
        let fabric = RdmaFabric::with_verbs(verbs.clone(), RdmaConfig::default()).expect("fabric");
        let env = TokioEnv::new(MemTransport::new(), fabric);
        let proxy = ProxyNode::start(env.clone(), ProxyConfig::default(), "proxy")
            .await
            .expect("proxy");
        let cfg = ReceiverConfig {
            buffer_slots: 16,
            ..ReceiverConfig::default()
        };
        assert!(cfg.require_checksums, "the default");
        let mut receiver = if lent {
            ReceiverNode::start_in(
                env.clone(),
                cfg,
                lent_as_layers(4, 4),
                "alloc",
                "127.0.0.1:0",
            )
            .await
        } else {
            ReceiverNode::start(env.clone(), cfg, CHUNK, "alloc", "127.0.0.1:0").await
        }
        .expect("receiver");
        let addr = ReceiverAddr {
            alloc: receiver.alloc_endpoint().to_owned(),
            fabric: receiver.fabric_endpoint().to_owned(),
        };
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let (ready_tx, ready) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(notice) = receiver.next_notice().await {
                match notice {
                    ReceiverNotice::Ready(r) => {
                        let _ = ready_tx.send(r.key.req_id.clone());
                        let d = synthetic::decode(receiver.reader(), r.clone(), CHUNK, true).await;
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
            ..SenderConfig::default()
        };
        assert!(sender_cfg.checksums, "the default");
        let proxy_endpoint = Some(proxy.endpoint().to_owned());
        let sender = if lent {
            let staging = lent_as_layers(2, 2);
            SenderNode::start_in(
                env.clone(),
                sender_cfg,
                staging,
                "s0".into(),
                proxy_endpoint,
            )
            .await
        } else {
            SenderNode::start(env.clone(), sender_cfg, CHUNK, "s0".into(), proxy_endpoint).await
        }
        .expect("sender");
        let peer = sender.add_receiver(addr).await.expect("connects");
        Rig {
            verbs,
            proxy,
            sender,
            peer,
            ended,
            ready,
        }
    }

    fn request(&self, id: &str) -> SyntheticRequest {
        SyntheticRequest {
            req_id: ReqId(id.into()),
            receiver: self.peer,
            chunks: 8,
            batch_chunks: 2,
            chunk_bytes: CHUNK,
        }
    }

    /// The receiver's outcome for `id` (others that end meanwhile are skipped).
    async fn outcome(&mut self, id: &ReqId) -> Outcome {
        tokio::time::timeout(STEP, async {
            while let Some((ended, outcome)) = self.ended.recv().await {
                if ended == *id {
                    return outcome;
                }
            }
            panic!("the receiver stopped");
        })
        .await
        .expect("bounded")
    }

    /// Sends a request until one goes through (a replaced connection comes up in the
    /// background; meanwhile a request fails with "no fabric connection"); its outcome at
    /// the receiver.
    async fn one_that_goes_through(&mut self) -> Outcome {
        let mut attempt = 0;
        let fine = loop {
            attempt += 1;
            let fine = self.request(&format!("fine-{attempt}"));
            let verdict = self
                .proxy
                .expect(fine.req_id.clone(), 1)
                .await
                .expect("fresh id");
            let sent = tokio::time::timeout(STEP, synthetic::prefill(&self.sender, &fine))
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
        self.outcome(&fine.req_id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_fails_its_request_everywhere_and_the_next_one_reconnects() {
    let mut rig = Rig::start().await;
    // The fourth write of "broken" fails like a link going down.
    rig.verbs.fail_write_after(3);
    let broken = rig.request("broken");
    let verdict = rig
        .proxy
        .expect(broken.req_id.clone(), 1)
        .await
        .expect("fresh id");
    let failed = tokio::time::timeout(STEP, synthetic::prefill(&rig.sender, &broken))
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
    let outcome = rig.outcome(&broken.req_id).await;
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");

    // Then a request completes, byte for byte, its checksums checked.
    assert_eq!(rig.one_that_goes_through().await, Outcome::Consumed);
}

/// The NIC model flips a byte of the third write after it landed (the write succeeds: only
/// kvx's checksum can tell): the receiver fails the request with a checksum mismatch before
/// it is ready, so the decoder never reads it; the next request goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_after_landing_fails_its_request_with_a_checksum_mismatch() {
    let mut rig = Rig::start().await;
    rig.verbs.corrupt_write_after(2, 1000);
    let corrupt = rig.request("corrupt");
    // The sender's writes all succeed at the NIC; whatever it hears (an aborted request once
    // the receiver failed it), the receiver's outcome is what counts.
    let _ = tokio::time::timeout(STEP, synthetic::prefill(&rig.sender, &corrupt))
        .await
        .expect("bounded");
    match rig.outcome(&corrupt.req_id).await {
        Outcome::Failed(Failure::Integrity(why)) => {
            assert!(why.contains("checksum mismatch"), "{why}");
        }
        other => panic!("the request must fail its checksum: {other:?}"),
    }
    assert_eq!(rig.one_that_goes_through().await, Outcome::Consumed);
    while let Ok(id) = rig.ready.try_recv() {
        assert_ne!(
            id, corrupt.req_id,
            "the decoder was handed the corrupt request"
        );
    }
}

/// The receive buffer and the staging lent as the vLLM connector lends its host buffer (one
/// allocation, a part per layer): each side registers one memory region, and requests go
/// through byte for byte, their checksums checked, one after another over the same buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffers_lent_as_layers_of_one_allocation_carry_whole_requests() {
    let mut rig = Rig::start_with(true).await;
    assert_eq!(rig.verbs.registrations(), 2, "one region each side");
    for n in 0..3 {
        let request = rig.request(&format!("layered-{n}"));
        let verdict = rig
            .proxy
            .expect(request.req_id.clone(), 1)
            .await
            .expect("fresh id");
        tokio::time::timeout(STEP, synthetic::prefill(&rig.sender, &request))
            .await
            .expect("bounded")
            .expect("sent");
        let proxy_says = tokio::time::timeout(STEP, verdict).await.expect("bounded");
        assert!(proxy_says.expect("answered").is_ok());
        assert_eq!(rig.outcome(&request.req_id).await, Outcome::Consumed);
    }
    assert_eq!(
        rig.verbs.registrations(),
        2,
        "registered once, not per request"
    );
}
