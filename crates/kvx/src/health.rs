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
//! that never sent one first) is closed for it. The accept loop itself never waits for a
//! free place, so a probe is answered whatever else is connected.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::task::AbortHandle;

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
        let table = Arc::new(Mutex::new(Connections::default()));
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
            let heard = Arc::new(AtomicU64::new(0));
            let id = lock(&table).open(from.ip());
            let (seen, done) = (heard.clone(), table.clone());
            let task = tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    seen.store(tick(), Ordering::Relaxed);
                    let answer = answer(&req, &handle, &ready);
                    async move { Ok::<_, Infallible>(answer) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_DEADLINE)
                    .serve_connection(TokioIo::new(stream), service);
                let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
                lock(&done).close(id);
            });
            lock(&table).admit(id, from.ip(), heard, task.abort_handle());
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

/// Milliseconds since the first call, plus one (0 means "never"): when a connection last
/// sent a request.
fn tick() -> u64 {
    static START: OnceLock<tokio::time::Instant> = OnceLock::new();
    let start = *START.get_or_init(tokio::time::Instant::now);
    start.elapsed().as_millis() as u64 + 1
}

fn lock(t: &Mutex<Connections>) -> MutexGuard<'_, Connections> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// One held connection: where from, when it last sent a request (0: never), how to close it.
struct Held {
    from: IpAddr,
    heard: Arc<AtomicU64>,
    abort: AbortHandle,
}

/// The connections held, by arrival.
#[derive(Default)]
struct Connections {
    next: u64,
    held: BTreeMap<u64, Held>,
}

impl Connections {
    /// Makes room for a connection from `from` (closing the quietest past a cap) and returns
    /// its id; `admit` then records how to close it.
    fn open(&mut self, from: IpAddr) -> u64 {
        let from_there = self.held.values().filter(|h| h.from == from).count();
        if from_there >= PER_SOURCE_MAX {
            self.evict(Some(from));
        }
        if self.held.len() >= CONNECTIONS_MAX {
            self.evict(None);
        }
        self.next += 1;
        self.next
    }

    fn admit(&mut self, id: u64, from: IpAddr, heard: Arc<AtomicU64>, abort: AbortHandle) {
        // A connection may already be over (closed before this call): it stays out.
        if abort.is_finished() {
            return;
        }
        self.held.insert(id, Held { from, heard, abort });
    }

    fn close(&mut self, id: u64) {
        self.held.remove(&id);
    }

    /// Closes the connection (from `from`, if given) that has gone longest without a
    /// request; one that never sent any goes first, the oldest of those first.
    fn evict(&mut self, from: Option<IpAddr>) {
        let quietest = self
            .held
            .iter()
            .filter(|(_, h)| from.is_none_or(|f| h.from == f))
            .min_by_key(|(id, h)| (h.heard.load(Ordering::Relaxed), **id))
            .map(|(id, _)| *id);
        if let Some(held) = quietest.and_then(|id| self.held.remove(&id)) {
            held.abort.abort();
        }
    }
}
