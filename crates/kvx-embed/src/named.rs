//! Transports and fabrics by name, the one mapping from the names users write (the `kvx`
//! binary's `--transport`/`--fabric`, Python's `transport=`/`fabric=`) to an `EnvChoice`;
//! `EnvChoice::names` is its inverse. The in-process ones ("mem") are the instances of an
//! `InProcess` the caller keeps: every part made with the same one reaches the others.

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_transport::tcp_fabric::TcpFabricConfig;
use kvx_transport::zmq::{CurveConfig, ZmqConfig};

use crate::choice::{EnvChoice, FabricChoice, TransportChoice};

/// Every transport name, in the order help texts list them.
pub const TRANSPORT_NAMES: [&str; 2] = ["zmq", "mem"];

/// Every fabric name, in the order help texts list them ("rdma" only in builds with the
/// `rdma` feature: the others refuse it, saying so).
pub const FABRIC_NAMES: [&str; 4] = ["tcp", "shm", "mem", "rdma"];

/// The in-process transport and fabric that "mem" names.
#[derive(Debug, Clone)]
pub struct InProcess {
    /// What "mem" names as a transport.
    pub transport: MemTransport,
    /// What "mem" names as a fabric.
    pub fabric: MemFabric,
}

impl InProcess {
    /// A fresh pair: parts made with it reach each other and nothing else.
    pub fn new() -> Self {
        Self {
            transport: MemTransport::new(),
            fabric: MemFabric::new(),
        }
    }
}

impl Default for InProcess {
    fn default() -> Self {
        Self::new()
    }
}

/// Why names make no environment; each says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Not a transport's name.
    #[error("transport {0:?}: choose \"zmq\" (between processes) or \"mem\" (this process)")]
    Transport(String),
    /// Not a fabric's name.
    #[error(
        "fabric {0:?}: choose \"tcp\", \"shm\" (one host), \"mem\" (this process) or \"rdma\""
    )]
    Fabric(String),
    /// "rdma" in a build without the `rdma` feature.
    #[error(
        "fabric \"rdma\": this build has no RDMA support (the kvx binary: rebuild with \
         `cargo build --release -p kvx --features rdma`; see docs/operations.md)"
    )]
    NoRdma,
    /// CURVE keys with a transport other than "zmq".
    #[error("CURVE keys with transport {0:?}: CURVE is for the \"zmq\" transport")]
    CurveNotZmq(String),
}

impl TransportChoice {
    /// The transport `name` names, with CURVE when `curve` is set ("zmq" only).
    pub fn named(
        name: &str,
        curve: Option<CurveConfig>,
        in_process: &InProcess,
    ) -> Result<Self, NameError> {
        if curve.is_some() && name != "zmq" {
            return Err(NameError::CurveNotZmq(name.to_owned()));
        }
        match name {
            "zmq" => Ok(Self::Zmq(ZmqConfig {
                curve: curve.map(Box::new),
                ..ZmqConfig::default()
            })),
            "mem" => Ok(Self::Mem(in_process.transport.clone())),
            other => Err(NameError::Transport(other.to_owned())),
        }
    }
}

impl FabricChoice {
    /// The fabric `name` names, with its default settings ("rdma": the first device; set
    /// the `RdmaConfig` inside for another).
    pub fn named(name: &str, in_process: &InProcess) -> Result<Self, NameError> {
        match name {
            "tcp" => Ok(Self::Tcp(TcpFabricConfig::default())),
            "shm" => Ok(Self::Shm),
            "mem" => Ok(Self::Mem(in_process.fabric.clone())),
            #[cfg(feature = "rdma")]
            "rdma" => Ok(Self::Rdma(kvx_rdma::RdmaConfig::default())),
            #[cfg(not(feature = "rdma"))]
            "rdma" => Err(NameError::NoRdma),
            other => Err(NameError::Fabric(other.to_owned())),
        }
    }
}

impl EnvChoice {
    /// The transport and fabric the names name (`TransportChoice::named`,
    /// `FabricChoice::named`).
    pub fn named(
        transport: &str,
        fabric: &str,
        curve: Option<CurveConfig>,
        in_process: &InProcess,
    ) -> Result<Self, NameError> {
        Ok(Self {
            transport: TransportChoice::named(transport, curve, in_process)?,
            fabric: FabricChoice::named(fabric, in_process)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_through_names() {
        let in_process = InProcess::new();
        for transport in TRANSPORT_NAMES {
            for fabric in FABRIC_NAMES {
                match EnvChoice::named(transport, fabric, None, &in_process) {
                    Ok(choice) => assert_eq!(choice.names(), (transport, fabric)),
                    Err(e) => {
                        assert_eq!(fabric, "rdma", "{transport}/{fabric}: {e}");
                        assert_eq!(e, NameError::NoRdma);
                    }
                }
            }
        }
    }

    #[test]
    fn unknown_names_say_what_to_write() {
        let in_process = InProcess::new();
        let e = EnvChoice::named("zeromq", "tcp", None, &in_process).expect_err("not a name");
        assert!(e.to_string().contains("\"zmq\""), "{e}");
        let e = EnvChoice::named("zmq", "ib", None, &in_process).expect_err("not a name");
        assert!(e.to_string().contains("\"shm\""), "{e}");
    }
}
