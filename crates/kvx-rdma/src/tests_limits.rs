//! The device's limits (`limits`), over the NIC model with small ones: a geometry beyond
//! them is refused up front naming the limit, and a receiver posts no more receives than a
//! queue holds.

use std::time::Duration;

use kvx_io::{Fabric, PostWrite, SlotMemory};
use kvx_proto::StagingSlot;

use crate::fake::FakeVerbs;
use crate::tests::{attach, completions, write};
use crate::{DeviceLimits, RdmaConfig, RdmaFabric};

const LIMITS: DeviceLimits = DeviceLimits {
    max_qp_wr: 8,
    max_cqe: 1024,
    max_msg_sz: 4096,
    max_mr_size: 64 * 4096,
};

fn fabric() -> RdmaFabric<FakeVerbs> {
    let config = RdmaConfig {
        fence_timeout: Duration::from_secs(2),
        ..RdmaConfig::default()
    };
    RdmaFabric::with_verbs(FakeVerbs::new().with_limits(LIMITS), config).expect("fabric")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_geometry_beyond_the_devices_limits_is_refused_naming_the_limit() {
    let f = fabric();
    let refused = |r: Result<_, kvx_io::FabricError>, limit: &str| {
        let e = r.expect_err("refused").to_string();
        assert!(e.contains(limit), "{e}");
    };
    refused(f.allocate_staging(9, 1024).map(|_| ()), "max_qp_wr");
    refused(f.allocate_staging(2, 8192).map(|_| ()), "max_msg_sz");
    refused(
        f.expose("127.0.0.1:0", 65, 4096).await.map(|_| ()),
        "max_mr_size",
    );
    refused(
        f.expose("127.0.0.1:0", 1, 4097).await.map(|_| ()),
        "max_msg_sz",
    );
    assert!(f.allocate_staging(8, 4096).is_ok());
    assert!(f.expose("127.0.0.1:0", 64, 4096).await.is_ok());
}

/// The receiver wants a receive per staging slot plus `recv_slack` (4 + 16) but the device
/// holds 8 per queue: it posts 8, and the writes beyond them wait for reposts (RNR).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_posts_no_more_receives_than_a_queue_holds() {
    let f = fabric();
    let mut listener = f.expose("127.0.0.1:0", 40, 1024).await.expect("expose");
    let staging = f.allocate_staging(4, 1024).expect("staging");
    let credential = attach(&listener, 0..40, 3);
    let mut conn = f
        .connect(&listener.local_endpoint, staging.clone(), credential)
        .await
        .expect("connect with a clamped receive queue");
    for i in 0..40u64 {
        staging.write_slot((i % 4) as u32, &[i as u8; 1024]);
        conn.post(PostWrite {
            local: StagingSlot((i % 4) as u32),
            ..write(i, i as u32, 3)
        })
        .expect("post");
        if i % 4 == 3 {
            let done = completions(&mut conn, 4).await;
            assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
        }
    }
    for _ in 0..40 {
        tokio::time::timeout(Duration::from_secs(10), listener.landed.recv())
            .await
            .expect("notice")
            .expect("open");
    }
}
