//! The kvx-io conformance bodies against `ZmqTransport` on loopback, with OS-chosen ports.

use kvx_io::conformance;
use kvx_transport::zmq::ZmqTransport;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_transport_request_reply() {
    let t = ZmqTransport::default();
    conformance::transport_request_reply(&t, "tcp://127.0.0.1:0", 200).await;
    let stats = t.stats();
    assert_eq!(
        stats.oversize_dropped + stats.malformed_dropped,
        0,
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_transport_notices() {
    let t = ZmqTransport::default();
    conformance::transport_notices(&t, "tcp://127.0.0.1:0", 200).await;
    let stats = t.stats();
    assert_eq!(
        stats.oversize_dropped + stats.malformed_dropped,
        0,
        "{stats:?}"
    );
}
