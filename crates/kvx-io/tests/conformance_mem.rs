//! The conformance suite against the in-memory implementations.

use kvx_io::conformance;
use kvx_io::mem::{MemFabric, MemTransport};

#[tokio::test]
async fn mem_transport_request_reply() {
    conformance::transport_request_reply(&MemTransport::new(), "alloc", 200).await;
}

#[tokio::test]
async fn mem_transport_notices() {
    conformance::transport_notices(&MemTransport::new(), "proxy", 200).await;
}

#[tokio::test]
async fn mem_fabric_writes_land_in_order() {
    conformance::fabric_writes_land_in_order(&MemFabric::new(), "buffer", 8, 4096).await;
}

#[tokio::test]
async fn mem_fabric_reset_flushes() {
    conformance::fabric_reset_flushes(&MemFabric::new(), "buffer").await;
}

#[tokio::test]
async fn mem_fabric_rejects_out_of_bounds() {
    conformance::fabric_rejects_out_of_bounds(&MemFabric::new(), "buffer").await;
}

#[tokio::test]
async fn mem_fabric_refuses_writes_outside_grants() {
    conformance::fabric_refuses_writes_outside_grants(&MemFabric::new(), "buffer", true).await;
}

#[tokio::test]
async fn mem_fabric_lands_only_whole_chunks() {
    conformance::fabric_lands_only_whole_chunks(&MemFabric::new(), "buffer", true).await;
}

#[tokio::test]
async fn mem_fabric_checks_checksums() {
    conformance::fabric_checks_checksums(&MemFabric::new(), "buffer").await;
}

#[tokio::test]
async fn mem_fabric_runs_land_as_their_pieces() {
    conformance::fabric_runs_land_as_their_pieces(&MemFabric::new(), "buffer", false).await;
    conformance::fabric_runs_land_as_their_pieces(&MemFabric::new(), "buffer2", true).await;
}

#[tokio::test]
async fn mem_fabric_uses_memory_the_caller_owns() {
    conformance::fabric_uses_memory_the_caller_owns(&MemFabric::new(), "buffer", true).await;
}
