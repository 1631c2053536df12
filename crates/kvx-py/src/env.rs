//! Transport and fabric by name, as Python passes them, through `kvx_embed::named` (the one
//! mapping, which the `kvx` binary uses too): `transport` "zmq" (separate processes,
//! LMCache's wire) or "mem" (this process only); `fabric` "tcp", "shm" (one host, kvx's own
//! shared mapping) or "mem" (this process only). The "mem" ones are one instance
//! per process, so every object made with them reaches the others. CURVE on the "zmq"
//! transport: `curve_server`, `curve_client` (certificate files, as `kvx keygen` and pyzmq's
//! `zmq.auth` write them).

use std::path::PathBuf;
use std::sync::OnceLock;

use kvx_embed::{EnvChoice, FabricChoice, InProcess, NameError};
use kvx_transport::zmq::{load_public_key, AllowList, CurveConfig, CurveKeyPair, ZmqConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

static IN_PROCESS: OnceLock<InProcess> = OnceLock::new();

/// The process's in-process transport and fabric ("mem"): one pair per process.
fn in_process() -> &'static InProcess {
    IN_PROCESS.get_or_init(InProcess::new)
}

/// CURVE for a bound socket (a `Receiver`'s ROUTER, a `Proxy`'s PULL): this end's secret
/// certificate and the directory of allowed clients' public certificates, both or neither.
pub(crate) fn curve_server(
    secret_key: Option<PathBuf>,
    allow: Option<PathBuf>,
) -> PyResult<Option<CurveConfig>> {
    let bad = |e: kvx_transport::zmq::CurveConfigError| PyValueError::new_err(e.to_string());
    match (secret_key, allow) {
        (None, None) => Ok(None),
        (Some(secret_key), Some(allow)) => Ok(Some(CurveConfig {
            keys: CurveKeyPair::load(&secret_key).map_err(bad)?,
            allowed_clients: Some(AllowList::load_dir(&allow).map_err(bad)?),
            server_key: None,
        })),
        _ => Err(PyValueError::new_err(
            "curve_secret_key and curve_allow: give both (CURVE on) or neither",
        )),
    }
}

/// CURVE for the connecting sockets (a `Sender`'s DEALERs and PUSH): this end's secret
/// certificate and the servers' public certificate, both or neither.
pub(crate) fn curve_client(
    secret_key: Option<PathBuf>,
    server_key: Option<PathBuf>,
) -> PyResult<Option<CurveConfig>> {
    let bad = |e: kvx_transport::zmq::CurveConfigError| PyValueError::new_err(e.to_string());
    match (secret_key, server_key) {
        (None, None) => Ok(None),
        (Some(secret_key), Some(server_key)) => Ok(Some(CurveConfig {
            keys: CurveKeyPair::load(&secret_key).map_err(bad)?,
            allowed_clients: None,
            server_key: Some(load_public_key(&server_key).map_err(bad)?),
        })),
        _ => Err(PyValueError::new_err(
            "curve_secret_key and curve_server_key: give both (CURVE on) or neither",
        )),
    }
}

/// The ZeroMQ heartbeats a `Sender` or `Receiver` was given (`heartbeat_interval=`,
/// `heartbeat_timeout=`, seconds; `docs/spec/zmq.md` §5.1). One given alone keeps the other's
/// default.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Heartbeats {
    pub(crate) interval: Option<f64>,
    pub(crate) timeout: Option<f64>,
}

/// The environment named by `transport` (with `curve`, from `curve_server` or
/// `curve_client`, and `heartbeats`) and `fabric` (`kvx_embed::named`, the mapping the `kvx`
/// binary uses).
pub(crate) fn choice(
    transport_name: &str,
    fabric: &str,
    curve: Option<CurveConfig>,
    heartbeats: Heartbeats,
) -> PyResult<EnvChoice> {
    let mut choice =
        EnvChoice::named(transport_name, fabric, curve, in_process()).map_err(bad_name)?;
    if heartbeats.interval.is_some() || heartbeats.timeout.is_some() {
        let zmq = ZmqConfig::default();
        let or_default = |given: Option<f64>, what, default| match given {
            Some(s) => crate::wait::positive_seconds(s, what),
            None => Ok(default),
        };
        let interval = or_default(
            heartbeats.interval,
            "heartbeat_interval",
            zmq.heartbeat_interval,
        )?;
        let timeout = or_default(
            heartbeats.timeout,
            "heartbeat_timeout",
            zmq.heartbeat_timeout,
        )?;
        choice
            .transport
            .set_heartbeats(interval, timeout)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
    }
    Ok(choice)
}

fn bad_name(e: NameError) -> PyErr {
    PyValueError::new_err(match e {
        // The package is built without RDMA: the binary's rebuild hint does not apply.
        NameError::NoRdma => {
            "fabric \"rdma\": this build of the kvx package has no RDMA support (build the \
             wheel with `maturin build --release --features rdma`; see docs/operations.md)"
                .into()
        }
        other => other.to_string(),
    })
}

/// Whether the fabric needs a shared mapping of its own (no caller memory, no views).
pub(crate) fn needs_own_mapping(choice: &EnvChoice) -> bool {
    matches!(choice.fabric, FabricChoice::Shm)
}
