//! Transport and fabric by name, as Python passes them: `transport` "zmq" (separate
//! processes, LMCache's wire) or "mem" (this process only); `fabric` "tcp", "shm" (one host,
//! kvx's own shared mapping) or "mem" (this process only). The "mem" ones are one instance
//! per process, so every object made with them reaches the others. CURVE on the "zmq"
//! transport: `curve_server`, `curve_client` (certificate files, as `kvx keygen` and pyzmq's
//! `zmq.auth` write them).

use std::path::PathBuf;
use std::sync::OnceLock;

use kvx_embed::{EnvChoice, FabricChoice, TransportChoice};
use kvx_io::mem::{MemFabric, MemTransport};
use kvx_transport::tcp_fabric::TcpFabricConfig;
use kvx_transport::zmq::{load_public_key, AllowList, CurveConfig, CurveKeyPair, ZmqConfig};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

static MEM: OnceLock<(MemTransport, MemFabric)> = OnceLock::new();

fn mem() -> &'static (MemTransport, MemFabric) {
    MEM.get_or_init(|| (MemTransport::new(), MemFabric::new()))
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

/// The transport named `name`, with CURVE when `curve` is set ("zmq" only).
pub(crate) fn transport(name: &str, curve: Option<CurveConfig>) -> PyResult<TransportChoice> {
    if curve.is_some() && name != "zmq" {
        return Err(PyValueError::new_err(format!(
            "CURVE keys with transport {name:?}: CURVE is for the \"zmq\" transport"
        )));
    }
    match name {
        "zmq" => Ok(TransportChoice::Zmq(ZmqConfig {
            curve: curve.map(Box::new),
            ..ZmqConfig::default()
        })),
        "mem" => Ok(TransportChoice::Mem(mem().0.clone())),
        other => Err(PyValueError::new_err(format!(
            "transport {other:?}: choose \"zmq\" (between processes) or \"mem\" (this process)"
        ))),
    }
}

/// The environment named by `transport` (with `curve`, from `curve_server` or
/// `curve_client`) and `fabric`.
pub(crate) fn choice(
    transport_name: &str,
    fabric: &str,
    curve: Option<CurveConfig>,
) -> PyResult<EnvChoice> {
    let fabric = match fabric {
        "tcp" => FabricChoice::Tcp(TcpFabricConfig::default()),
        "shm" => FabricChoice::Shm,
        "mem" => FabricChoice::Mem(mem().1.clone()),
        "rdma" => {
            return Err(PyValueError::new_err(
                "fabric \"rdma\": this build of the kvx package has no RDMA support",
            ))
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "fabric {other:?}: choose \"tcp\", \"shm\" (one host) or \"mem\" (this process)"
            )))
        }
    };
    Ok(EnvChoice {
        transport: transport(transport_name, curve)?,
        fabric,
    })
}

/// Whether the fabric needs a shared mapping of its own (no caller memory, no views).
pub(crate) fn needs_own_mapping(choice: &EnvChoice) -> bool {
    matches!(choice.fabric, FabricChoice::Shm)
}
