//! Picking a transport and fabric at runtime. Drivers are generic over `Env`; this module is
//! the one place that names concrete implementations, with a `match`, not `dyn`.

use std::process::ExitCode;

use anyhow::Context;
use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;
use kvx_transport::shm_fabric::ShmFabric;
use kvx_transport::tcp_fabric::TcpFabric;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

use crate::cli::{
    DemoArgs, FabricKind, ProxyArgs, RdmaArgs, ReceiverArgs, SenderArgs, TransportKind,
};
use crate::demo::{self, Endpoints};
use crate::roles::{self, Style};

fn zmq() -> anyhow::Result<ZmqTransport> {
    ZmqTransport::new(ZmqConfig::default()).context("ZeroMQ transport")
}

const ZMQ_STYLE: Style = Style {
    control: |h, p| format!("tcp://{h}:{p}"),
    fabric: |h, p| format!("{h}:{p}"),
};

/// The RDMA fabric on the configured device; without one (or without libibverbs) an error
/// that says "no RDMA device found".
#[cfg(feature = "rdma")]
pub fn rdma(args: &RdmaArgs) -> anyhow::Result<kvx_rdma::IbvFabric> {
    let config = kvx_rdma::RdmaConfig {
        device: args.rdma_device.clone(),
        port: args.rdma_port,
        gid_index: args.rdma_gid_index,
        mtu: match args.rdma_mtu {
            Some(m) => Some(m.to_string().parse().map_err(anyhow::Error::msg)?),
            None => None,
        },
        ..kvx_rdma::RdmaConfig::default()
    };
    Ok(kvx_rdma::RdmaFabric::open(config)?)
}

/// This build has no RDMA backend: say how to get one.
#[cfg(not(feature = "rdma"))]
pub fn rdma(_: &RdmaArgs) -> anyhow::Result<std::convert::Infallible> {
    anyhow::bail!(
        "--fabric rdma: this kvx was built without RDMA support; rebuild it with \
         `cargo build --release -p kvx --features rdma` (needs cmake and libclang; see docs/operations.md)"
    )
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let json = args.workload.json;
    let loopback = |t: &str, f: &str| Endpoints {
        transport_name: t.into(),
        fabric_name: f.into(),
        alloc: "tcp://127.0.0.1:0".into(),
        proxy: "tcp://127.0.0.1:0".into(),
        fabric: "127.0.0.1:0".into(),
    };
    let (summary, code) = match (args.transport, args.fabric) {
        (TransportKind::Zmq, FabricKind::Tcp) => {
            demo::run_on(
                TokioEnv::new(zmq()?, TcpFabric::new()),
                loopback("zmq", "tcp"),
                args,
            )
            .await?
        }
        (TransportKind::Zmq, FabricKind::Shm) => {
            demo::run_on(
                TokioEnv::new(zmq()?, ShmFabric::new()),
                loopback("zmq", "shm"),
                args,
            )
            .await?
        }
        (TransportKind::Zmq, FabricKind::Mem) => {
            demo::run_on(
                TokioEnv::new(zmq()?, MemFabric::new()),
                loopback("zmq", "mem"),
                args,
            )
            .await?
        }
        (TransportKind::Mem, fabric) => {
            let endpoints = Endpoints {
                transport_name: "mem".into(),
                fabric_name: format!("{fabric:?}").to_lowercase(),
                alloc: "alloc".into(),
                proxy: "proxy".into(),
                fabric: if fabric == FabricKind::Mem {
                    "buffer".into()
                } else {
                    "127.0.0.1:0".into()
                },
            };
            match fabric {
                FabricKind::Mem => {
                    demo::run_on(
                        TokioEnv::new(MemTransport::new(), MemFabric::new()),
                        endpoints,
                        args,
                    )
                    .await?
                }
                FabricKind::Tcp => {
                    demo::run_on(
                        TokioEnv::new(MemTransport::new(), TcpFabric::new()),
                        endpoints,
                        args,
                    )
                    .await?
                }
                FabricKind::Shm => {
                    demo::run_on(
                        TokioEnv::new(MemTransport::new(), ShmFabric::new()),
                        endpoints,
                        args,
                    )
                    .await?
                }
                FabricKind::Rdma => return demo_rdma(args).await,
            }
        }
        (TransportKind::Zmq, FabricKind::Rdma) => return demo_rdma(args).await,
    };
    print_summary(json, &summary, code)
}

fn print_summary(json: bool, summary: &demo::Summary, code: ExitCode) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string(summary)?);
    } else {
        demo::print_table(summary);
    }
    Ok(code)
}

/// The demo over RDMA: the side channels on loopback, the writes through the NIC.
#[cfg(feature = "rdma")]
async fn demo_rdma(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let fabric = rdma(&args.rdma)?;
    let json = args.workload.json;
    let (summary, code) = match args.transport {
        TransportKind::Zmq => {
            let endpoints = Endpoints {
                transport_name: "zmq".into(),
                fabric_name: "rdma".into(),
                alloc: "tcp://127.0.0.1:0".into(),
                proxy: "tcp://127.0.0.1:0".into(),
                fabric: "127.0.0.1:0".into(),
            };
            demo::run_on(TokioEnv::new(zmq()?, fabric), endpoints, args).await?
        }
        TransportKind::Mem => {
            let endpoints = Endpoints {
                transport_name: "mem".into(),
                fabric_name: "rdma".into(),
                alloc: "alloc".into(),
                proxy: "proxy".into(),
                fabric: "127.0.0.1:0".into(),
            };
            demo::run_on(TokioEnv::new(MemTransport::new(), fabric), endpoints, args).await?
        }
    };
    print_summary(json, &summary, code)
}

#[cfg(not(feature = "rdma"))]
async fn demo_rdma(args: DemoArgs) -> anyhow::Result<ExitCode> {
    match rdma(&args.rdma)? {}
}

/// A fabric for a multi-process role: the in-process one cannot cross processes.
fn cross_process(kind: FabricKind) -> anyhow::Result<FabricKind> {
    anyhow::ensure!(
        kind != FabricKind::Mem,
        "--fabric mem works only inside one process (kvx demo); use tcp, shm or rdma"
    );
    Ok(kind)
}

pub async fn receiver(args: ReceiverArgs) -> anyhow::Result<ExitCode> {
    match cross_process(args.fabric)? {
        FabricKind::Shm => {
            roles::receiver(TokioEnv::new(zmq()?, ShmFabric::new()), ZMQ_STYLE, args).await
        }
        #[cfg(feature = "rdma")]
        FabricKind::Rdma => {
            let fabric = rdma(&args.rdma)?;
            roles::receiver(TokioEnv::new(zmq()?, fabric), ZMQ_STYLE, args).await
        }
        #[cfg(not(feature = "rdma"))]
        FabricKind::Rdma => match rdma(&args.rdma)? {},
        _ => roles::receiver(TokioEnv::new(zmq()?, TcpFabric::new()), ZMQ_STYLE, args).await,
    }
}

pub async fn sender(args: SenderArgs) -> anyhow::Result<ExitCode> {
    match cross_process(args.fabric)? {
        FabricKind::Shm => {
            roles::sender(TokioEnv::new(zmq()?, ShmFabric::new()), ZMQ_STYLE, args).await
        }
        #[cfg(feature = "rdma")]
        FabricKind::Rdma => {
            let fabric = rdma(&args.rdma)?;
            roles::sender(TokioEnv::new(zmq()?, fabric), ZMQ_STYLE, args).await
        }
        #[cfg(not(feature = "rdma"))]
        FabricKind::Rdma => match rdma(&args.rdma)? {},
        _ => roles::sender(TokioEnv::new(zmq()?, TcpFabric::new()), ZMQ_STYLE, args).await,
    }
}

pub async fn proxy(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    // The proxy moves no KV bytes; any fabric type will do for its environment.
    roles::proxy(TokioEnv::new(zmq()?, MemFabric::new()), ZMQ_STYLE, args).await
}
