//! `--metrics ADDR` of `kvx receiver|sender|proxy`: one small HTTP server per process with
//! `GET /metrics` (every `kvx_*` metric the process records, Prometheus text) and
//! `GET /ready` (`200 ready` while the role takes work; `503` before it is up and once it
//! stops, so that a load balancer or an orchestrator's probe drains it first).
//!
//! hyper serves it (already in the tree under the Prometheus exporter); its own listener has
//! no readiness route, so the exporter only renders (`install_recorder`).
//!
//! Budgets, so that idle or hostile connections never lock a probe out: a connection must
//! send its request line and headers within `HEADER_DEADLINE` (and each later request's on a
//! kept-alive one), and lives at most `CONNECTION_TIMEOUT`. At most `CONNECTIONS_MAX`
//! connections are held, `PER_SOURCE_MAX` from one address; a connection arriving past
//! either cap is taken, and the connection that has gone longest without a request (those
//! that never sent one first) is closed for it (`kvx_io::ConnectionBudget`). The accept loop
//! itself never waits for a free place, so a probe is answered whatever else is connected.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kvx_io::ConnectionBudget;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

const CONNECTIONS_MAX: usize = 64;
const PER_SOURCE_MAX: usize = 16;
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_DEADLINE: Duration = Duration::from_secs(2);
/// How often histograms and idle metrics are tidied (the exporter's upkeep).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Whether the role takes work; `/ready` reports it.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Starts serving at `addr` (`role` names the process in the log line); the readiness it
/// reports starts false. A bad or busy address is an error at once.
pub async fn serve(addr: &str, role: &str) -> anyhow::Result<Readiness> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("--metrics {addr:?} is not host:port"))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("serving metrics at {addr}"))?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let readiness = Readiness::default();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(UPKEEP_EVERY).await;
            upkeep.run_upkeep();
        }
    });
    let ready = readiness.clone();
    tokio::spawn(async move {
        let budget = ConnectionBudget::new(CONNECTIONS_MAX, PER_SOURCE_MAX);
        loop {
            let (stream, from) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (handle, ready) = (handle.clone(), ready.clone());
            let (held, _) = budget.open(from.ip());
            let held = Arc::new(held);
            tokio::spawn(async move {
                let heard = held.clone();
                let service = hyper::service::service_fn(move |req| {
                    heard.heard();
                    let answer = answer(&req, &handle, &ready);
                    async move { Ok::<_, Infallible>(answer) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_DEADLINE)
                    .serve_connection(TokioIo::new(stream), service);
                let _ = held
                    .run(tokio::time::timeout(CONNECTION_TIMEOUT, conn))
                    .await;
            });
        }
    });
    eprintln!("kvx {role}: metrics at http://{addr}/metrics, readiness at http://{addr}/ready");
    Ok(readiness)
}

fn answer<B>(
    req: &Request<B>,
    handle: &PrometheusHandle,
    ready: &Readiness,
) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    if req.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
    }
    match req.uri().path() {
        "/metrics" => reply(StatusCode::OK, handle.render()),
        "/ready" if ready.is_ready() => reply(StatusCode::OK, "ready\n".into()),
        "/ready" => reply(StatusCode::SERVICE_UNAVAILABLE, "not ready\n".into()),
        _ => reply(StatusCode::NOT_FOUND, "/metrics or /ready\n".into()),
    }
}
