//! Transport and fabric, chosen at run time. `EnvChoice::into_env` is the one `match` that
//! turns a choice into the concrete transport and fabric, handed on as objects (`AnyEnv`,
//! kvx-io's `any_env`): every driver of an embedding program is then one type,
//! `SenderNode<AnyEnv>` and the like, whatever was chosen.

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::AnyEnv;
use kvx_transport::shm_fabric::ShmFabric;
use kvx_transport::tcp_fabric::{TcpFabric, TcpFabricConfig};
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

/// How control messages travel.
#[derive(Debug, Clone)]
pub enum TransportChoice {
    /// ZeroMQ, speaking LMCache's socket pattern and framing (ROUTER/DEALER, PUSH/PULL).
    Zmq(ZmqConfig),
    /// In-process channels: every part in one process, sharing this instance.
    Mem(MemTransport),
}

/// How KV bytes travel.
#[derive(Debug, Clone)]
pub enum FabricChoice {
    /// One-sided writes carried over TCP.
    Tcp(TcpFabricConfig),
    /// Shared memory, sender and receiver on one host: the receiver copies each admitted
    /// write out of the sender's staging (kvx allocates both regions: a shared mapping).
    Shm,
    /// In-process copies: every part in one process, sharing this instance.
    Mem(MemFabric),
    /// RDMA WRITE with immediate over verbs (RoCE, InfiniBand).
    #[cfg(feature = "rdma")]
    Rdma(kvx_rdma::RdmaConfig),
}

/// A transport and a fabric.
#[derive(Debug, Clone)]
pub struct EnvChoice {
    /// What carries the control messages (alloc requests and replies, proxy notices).
    pub transport: TransportChoice,
    /// What carries the chunks' bytes into the receiver's buffer.
    pub fabric: FabricChoice,
}

/// Why an environment could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// The ZeroMQ settings cannot work (a zero or over-long timeout, a limit out of range;
    /// the message says which): fix the configuration.
    #[error("ZeroMQ transport: {0}")]
    Zmq(#[source] kvx_transport::zmq::ZmqConfigError),
    /// The RDMA fabric could not be opened (no device, no device of the configured name,
    /// one that cannot be used as configured).
    #[cfg(feature = "rdma")]
    #[error("RDMA fabric: {0}")]
    Rdma(#[source] kvx_rdma::RdmaError),
}

/// Why heartbeat settings could not be applied (`TransportChoice::set_heartbeats`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HeartbeatError {
    /// Heartbeats are the ZeroMQ transport's (`docs/spec/zmq.md` §5.1); the in-process one
    /// has no connection to lose.
    #[error("heartbeats are settings of the \"zmq\" transport, not of {0:?}")]
    NotZmq(&'static str),
    /// The pair cannot work (zero, over a day, or a timeout under twice the interval).
    #[error("{0}")]
    Invalid(#[source] kvx_transport::zmq::ZmqConfigError),
}

impl TransportChoice {
    /// Sets the ZeroMQ transport's heartbeats (`docs/spec/zmq.md` §5.1), checked together:
    /// the one place the `kvx` binary's flags and the Python keywords both go through.
    pub fn set_heartbeats(
        &mut self,
        interval: std::time::Duration,
        timeout: std::time::Duration,
    ) -> Result<(), HeartbeatError> {
        match self {
            Self::Zmq(config) => {
                let changed = ZmqConfig {
                    heartbeat_interval: interval,
                    heartbeat_timeout: timeout,
                    ..config.clone()
                };
                changed.validate().map_err(HeartbeatError::Invalid)?;
                *config = changed;
                Ok(())
            }
            Self::Mem(_) => Err(HeartbeatError::NotZmq("mem")),
        }
    }
}

impl EnvChoice {
    /// ZeroMQ with its default settings and the TCP fabric: what separate processes use.
    pub fn zmq_tcp() -> Self {
        Self {
            transport: TransportChoice::Zmq(ZmqConfig::default()),
            fabric: FabricChoice::Tcp(TcpFabricConfig::default()),
        }
    }

    /// Short names for logs and summaries: ("zmq" | "mem", "tcp" | "shm" | "mem" | "rdma").
    pub fn names(&self) -> (&'static str, &'static str) {
        let transport = match self.transport {
            TransportChoice::Zmq(_) => "zmq",
            TransportChoice::Mem(_) => "mem",
        };
        let fabric = match self.fabric {
            FabricChoice::Tcp(_) => "tcp",
            FabricChoice::Shm => "shm",
            FabricChoice::Mem(_) => "mem",
            #[cfg(feature = "rdma")]
            FabricChoice::Rdma(_) => "rdma",
        };
        (transport, fabric)
    }

    /// Makes the transport and the fabric (a ZeroMQ context, an RDMA device opened) and
    /// hands them on as one environment.
    pub fn into_env(self) -> Result<AnyEnv, EnvError> {
        match self.transport {
            TransportChoice::Zmq(cfg) => {
                let transport = ZmqTransport::new(cfg).map_err(EnvError::Zmq)?;
                with_fabric(transport, self.fabric)
            }
            TransportChoice::Mem(transport) => with_fabric(transport, self.fabric),
        }
    }
}

fn with_fabric<T: kvx_io::Transport>(
    transport: T,
    fabric: FabricChoice,
) -> Result<AnyEnv, EnvError> {
    Ok(match fabric {
        FabricChoice::Tcp(cfg) => AnyEnv::of(transport, TcpFabric::with_config(cfg)),
        FabricChoice::Shm => AnyEnv::of(transport, ShmFabric::new()),
        FabricChoice::Mem(fabric) => AnyEnv::of(transport, fabric),
        #[cfg(feature = "rdma")]
        FabricChoice::Rdma(cfg) => {
            let fabric = kvx_rdma::RdmaFabric::open(cfg).map_err(EnvError::Rdma)?;
            AnyEnv::of(transport, fabric)
        }
    })
}
