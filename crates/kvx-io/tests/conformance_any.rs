//! The conformance suite against the in-memory implementations behind `AnyTransport` and
//! `AnyFabric`: the objects forward every call, so each check holds through them too.

use kvx_io::conformance;
use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::{AnyFabric, AnyTransport};

fn transport() -> AnyTransport {
    AnyTransport::new(MemTransport::new())
}

fn fabric() -> AnyFabric {
    AnyFabric::new(MemFabric::new())
}

#[tokio::test]
async fn any_transport_request_reply() {
    conformance::transport_request_reply(&transport(), "alloc", 200).await;
}

#[tokio::test]
async fn any_transport_notices() {
    conformance::transport_notices(&transport(), "proxy", 200).await;
}

#[tokio::test]
async fn any_fabric_writes_land_in_order() {
    conformance::fabric_writes_land_in_order(&fabric(), "buffer", 8, 4096).await;
}

#[tokio::test]
async fn any_fabric_reset_flushes() {
    conformance::fabric_reset_flushes(&fabric(), "buffer").await;
}

#[tokio::test]
async fn any_fabric_rejects_out_of_bounds() {
    conformance::fabric_rejects_out_of_bounds(&fabric(), "buffer").await;
}

#[tokio::test]
async fn any_fabric_refuses_writes_outside_grants() {
    conformance::fabric_refuses_writes_outside_grants(&fabric(), "buffer", true).await;
}

#[tokio::test]
async fn any_fabric_lands_only_whole_chunks() {
    conformance::fabric_lands_only_whole_chunks(&fabric(), "buffer", true).await;
}

#[tokio::test]
async fn any_fabric_checks_checksums() {
    conformance::fabric_checks_checksums(&fabric(), "buffer").await;
}

#[tokio::test]
async fn any_fabric_runs_land_as_their_pieces() {
    conformance::fabric_runs_land_as_their_pieces(&fabric(), "buffer", false).await;
    conformance::fabric_runs_land_as_their_pieces(&fabric(), "buffer2", true).await;
}

#[tokio::test]
async fn any_fabric_uses_memory_the_caller_owns() {
    conformance::fabric_uses_memory_the_caller_owns(&fabric(), "buffer", true).await;
}
