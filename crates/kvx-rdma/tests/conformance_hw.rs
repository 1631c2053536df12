//! The kvx-io conformance bodies against `RdmaFabric` on a real device (feature `rdma`).
//! Skipped, with a message, where no device can be opened (no libibverbs, no NIC, no
//! Soft-RoCE). `KVX_RDMA_DEVICE` / `KVX_RDMA_GID_INDEX` pick the device and GID; the side
//! channel runs on 127.0.0.1, so both ends of each test share the one device (loopback
//! through the NIC). `KVX_REQUIRE_RDMA=1` turns a skip into a failure (for machines that have
//! a device and must test it).
#![cfg(feature = "rdma")]

use kvx_io::conformance;
use kvx_rdma::{IbvFabric, RdmaConfig, RdmaError, RdmaFabric};

fn open() -> Option<IbvFabric> {
    let config = RdmaConfig {
        device: std::env::var("KVX_RDMA_DEVICE").ok(),
        gid_index: std::env::var("KVX_RDMA_GID_INDEX")
            .ok()
            .and_then(|s| s.parse().ok()),
        ..RdmaConfig::default()
    };
    match RdmaFabric::open(config) {
        Ok(f) => Some(f),
        Err(e @ RdmaError::NoDevice(_)) => {
            assert!(
                std::env::var("KVX_REQUIRE_RDMA").as_deref() != Ok("1"),
                "KVX_REQUIRE_RDMA=1 but {e}"
            );
            eprintln!("SKIPPED: RDMA conformance needs a device: {e}");
            None
        }
        Err(e) => panic!("an RDMA device is present but cannot be used: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_writes_land_in_order() {
    let Some(f) = open() else { return };
    conformance::fabric_writes_land_in_order(&f, "127.0.0.1:0", 16, 4096).await;
    conformance::fabric_writes_land_in_order(&f, "127.0.0.1:0", 8, 1 << 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_reset_flushes() {
    let Some(f) = open() else { return };
    conformance::fabric_reset_flushes(&f, "127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_uses_memory_the_caller_owns() {
    let Some(f) = open() else { return };
    conformance::fabric_uses_memory_the_caller_owns(&f, "127.0.0.1:0", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_rejects_out_of_bounds() {
    let Some(f) = open() else { return };
    conformance::fabric_rejects_out_of_bounds(&f, "127.0.0.1:0").await;
}

#[test]
fn without_a_device_open_says_so_and_does_not_panic() {
    // Whatever this machine has, opening is an answer, never a panic; a named device that is
    // not there is an error that lists what is.
    let named = RdmaFabric::open(RdmaConfig {
        device: Some("kvx-no-such-device".into()),
        ..RdmaConfig::default()
    });
    match named {
        Err(RdmaError::NoDevice(m)) => assert!(!m.is_empty()),
        Err(RdmaError::DeviceNotFound { name, .. }) => assert_eq!(name, "kvx-no-such-device"),
        other => panic!("unexpected {other:?}"),
    }
}
