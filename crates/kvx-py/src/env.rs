//! Transport and fabric by name, as Python passes them: `transport` "zmq" (separate
//! processes, LMCache's wire) or "mem" (this process only); `fabric` "tcp", "shm" (one host,
//! kvx's own shared mapping) or "mem" (this process only). The "mem" ones are one instance
//! per process, so every object made with them reaches the others.

use std::sync::OnceLock;

use kvx_embed::{EnvChoice, FabricChoice, TransportChoice};
use kvx_io::mem::{MemFabric, MemTransport};
use kvx_transport::tcp_fabric::TcpFabricConfig;
use kvx_transport::zmq::ZmqConfig;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

static MEM: OnceLock<(MemTransport, MemFabric)> = OnceLock::new();

fn mem() -> &'static (MemTransport, MemFabric) {
    MEM.get_or_init(|| (MemTransport::new(), MemFabric::new()))
}

/// The transport named `name`.
pub(crate) fn transport(name: &str) -> PyResult<TransportChoice> {
    match name {
        "zmq" => Ok(TransportChoice::Zmq(ZmqConfig::default())),
        "mem" => Ok(TransportChoice::Mem(mem().0.clone())),
        other => Err(PyValueError::new_err(format!(
            "transport {other:?}: choose \"zmq\" (between processes) or \"mem\" (this process)"
        ))),
    }
}

/// The environment named by `transport` and `fabric`.
pub(crate) fn choice(transport_name: &str, fabric: &str) -> PyResult<EnvChoice> {
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
        transport: transport(transport_name)?,
        fabric,
    })
}

/// Whether the fabric needs a shared mapping of its own (no caller memory, no views).
pub(crate) fn needs_own_mapping(choice: &EnvChoice) -> bool {
    matches!(choice.fabric, FabricChoice::Shm)
}
