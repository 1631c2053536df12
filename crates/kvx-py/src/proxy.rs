//! `kvx.Proxy`: awaits each request's notices from every decoder TP rank, as a serving
//! router does before it dispatches the decode.

use std::path::PathBuf;
use std::sync::Mutex;

use kvx_embed::TransportChoice;
use kvx_proto::proxy::ProxyEvent;
use kvx_proto::ProxyConfig;
use kvx_transport::zmq::ZmqConfig;
use pyo3::prelude::*;

use crate::{env, errors, runtime, wait};

/// The notice channel of a proxy (a ZeroMQ PULL socket LMCache's and kvx's senders push
/// ``ProxyNotif`` and ``FailNotif`` to).
///
/// ``Proxy(endpoint="tcp://127.0.0.1:0", *, kv_ready_timeout=None, standalone_tp_ranks=None,
/// ranks_per_connection=None, curve_secret_key=None, curve_allow=None)``:
/// binds ``endpoint`` (port 0: the OS picks; read ``endpoint`` back). ``kv_ready_timeout``
/// ``None`` is kvx's default, the one ``kvx proxy`` runs with (``kvx.defaults()["proxy"]``). With
/// ``standalone_tp_ranks`` set, every request id is awaited from its first notice, from that
/// many TP ranks, and outcomes come from ``next_event``; otherwise call ``expect`` for each
/// request before its prefill starts. ``ranks_per_connection``: the TP ranks of one request
/// one sender's connection may speak for (``None``: 1, one connection per rank, as each
/// ``Sender`` and each LMCache process has); its further notices for the request are refused,
/// not counted as more ranks. ``curve_secret_key``, ``curve_allow``: CURVE on the notice
/// channel (both or neither), as for ``Receiver``; a request then counts notices only from the
/// key of its first notice.
#[pyclass(module = "kvx", frozen)]
pub(crate) struct Proxy {
    inner: kvx_embed::Proxy,
}

/// One awaited request's outcome, to come (from ``Proxy.expect``).
#[pyclass(module = "kvx")]
pub(crate) struct ProxyWait {
    inner: Mutex<Option<kvx_embed::ProxyWait>>,
    req_id: String,
}

#[pymethods]
impl Proxy {
    #[new]
    #[pyo3(signature = (endpoint = "tcp://127.0.0.1:0", *, kv_ready_timeout = None,
        standalone_tp_ranks = None, ranks_per_connection = None, curve_secret_key = None,
        curve_allow = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        kv_ready_timeout: Option<f64>,
        standalone_tp_ranks: Option<u32>,
        ranks_per_connection: Option<u32>,
        curve_secret_key: Option<PathBuf>,
        curve_allow: Option<PathBuf>,
    ) -> PyResult<Self> {
        let curve = env::curve_server(curve_secret_key, curve_allow)?;
        let core = ProxyConfig::default();
        let kv_ready_timeout = match kv_ready_timeout {
            Some(s) => wait::positive_seconds(s, "kv_ready_timeout")?,
            None => core.kv_ready_timeout,
        };
        let cfg = ProxyConfig {
            kv_ready_timeout,
            await_on_first_notice: standalone_tp_ranks,
            ranks_per_connection: ranks_per_connection.unwrap_or(core.ranks_per_connection),
            ..core
        }
        // Checked here, once: kvx's driver and core take it as it is.
        .validate()
        .map_err(errors::start)?;
        let rt = runtime::get()?;
        let transport = TransportChoice::Zmq(ZmqConfig {
            curve: curve.map(Box::new),
            ..ZmqConfig::default()
        });
        let inner = py
            .detach(|| kvx_embed::Proxy::start(rt, transport, endpoint, cfg))
            .map_err(errors::start)?;
        Ok(Self { inner })
    }

    /// The bound endpoint, ``tcp://host:port``.
    #[getter]
    fn endpoint(&self) -> String {
        self.inner.endpoint().to_owned()
    }

    /// Starts awaiting ``req_id`` from ``tp_ranks`` senders; returns its ``ProxyWait``.
    #[pyo3(signature = (req_id, tp_ranks = 1))]
    fn expect(&self, py: Python<'_>, req_id: &str, tp_ranks: u32) -> PyResult<ProxyWait> {
        let wait = py
            .detach(|| self.inner.expect(req_id, tp_ranks))
            .map_err(|e| errors::expect_error(&e))?;
        Ok(ProxyWait {
            inner: Mutex::new(Some(wait)),
            req_id: req_id.to_owned(),
        })
    }

    /// The next outcome of a request no ``expect`` awaits (a standalone proxy), as
    /// ``(req_id, None)`` when it is ready or ``(req_id, reason)`` when it failed; ``None``
    /// when none comes within ``timeout`` seconds (``None``: wait as long as it takes).
    #[pyo3(signature = (timeout = None))]
    fn next_event(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(String, Option<String>)>> {
        let timeout = wait::seconds(timeout)?;
        let event = wait::interruptibly(py, timeout, self.inner.event())?.flatten();
        Ok(event.map(|ev| match ev {
            ProxyEvent::Ready { req_id } => (req_id.0, None),
            ProxyEvent::Failed { req_id, failure } => (req_id.0, Some(failure.to_string())),
        }))
    }

    fn __repr__(&self) -> String {
        format!("kvx.Proxy({:?})", self.inner.endpoint())
    }
}

#[pymethods]
impl ProxyWait {
    /// Waits for the outcome: returns when every TP rank reported; raises ``RefusedError``
    /// (a sender reported failure), ``TimedOutError`` (``kv_ready_timeout`` passed, or
    /// ``timeout`` seconds here) or ``StoppedError`` (the proxy stopped).
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = wait::seconds(timeout)?;
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(waiting) = guard.as_mut() else {
            return Err(errors::MisuseError::new_err(format!(
                "the outcome of {} was already returned",
                self.req_id
            )));
        };
        let outcome = wait::interruptibly(py, timeout, waiting.next_outcome())?;
        match outcome {
            None => Err(errors::TimedOutError::new_err(format!(
                "no outcome for {} within the timeout",
                self.req_id
            ))),
            Some(outcome) => {
                *guard = None;
                outcome.map_err(|f| errors::proxy_failure(&f))
            }
        }
    }

    /// The request id awaited.
    #[getter]
    fn req_id(&self) -> &str {
        &self.req_id
    }

    fn __repr__(&self) -> String {
        format!("kvx.ProxyWait({:?})", self.req_id)
    }
}
