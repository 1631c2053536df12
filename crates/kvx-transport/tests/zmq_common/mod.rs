//! What the ZMQ transport's loopback tests share (`zmq_resilience.rs`, `zmq_heartbeats.rs`,
//! `zmq_epochs.rs`): a bounded wait, a configuration with fast reconnects, and binding an
//! endpoint again once its previous socket let go of the port.
#![allow(dead_code)] // each test file uses its own part

use std::time::Duration;

use kvx_io::transport::ControlServer;
use kvx_io::Transport;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

/// Every wait of these tests is bounded by this.
pub const STEP: Duration = Duration::from_secs(10);

/// `fut`, or a panic naming `what` after `STEP`.
pub async fn step<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {STEP:?}"))
}

/// Fast reconnects, so the tests spend little time waiting.
pub fn quick() -> ZmqConfig {
    ZmqConfig {
        connect_timeout: Duration::from_millis(500),
        reconnect_backoff_min: Duration::from_millis(20),
        reconnect_backoff_max: Duration::from_millis(200),
        ..ZmqConfig::default()
    }
}

pub fn transport(config: ZmqConfig) -> ZmqTransport {
    ZmqTransport::new(config).expect("valid config")
}

/// Binds `endpoint` again once the previous socket has let go of the port (bounded).
pub async fn serve_again(t: &ZmqTransport, endpoint: &str) -> ControlServer {
    for _ in 0..100 {
        match t.serve(endpoint).await {
            Ok(server) => return server,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    panic!("could not bind {endpoint} again within 5 s");
}
