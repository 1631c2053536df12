//! Picking a transport and fabric at runtime. Drivers are generic over `Env`; this module is
//! the one place that names concrete implementations, with a `match`, not `dyn`.

use std::process::ExitCode;

use anyhow::Context;
use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;
use kvx_transport::shm_fabric::ShmFabric;
use kvx_transport::tcp_fabric::TcpFabric;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

use crate::cli::{DemoArgs, FabricKind, ProxyArgs, ReceiverArgs, SenderArgs, TransportKind};
use crate::demo;
use crate::roles::{self, Style};

/// Where the demo's parts listen (port 0: the OS picks).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub transport_name: String,
    pub fabric_name: String,
    pub alloc: String,
    pub proxy: String,
    pub fabric: String,
}

fn zmq() -> anyhow::Result<ZmqTransport> {
    ZmqTransport::new(ZmqConfig::default()).context("ZeroMQ transport")
}

const ZMQ_STYLE: Style = Style {
    control: |h, p| format!("tcp://{h}:{p}"),
    fabric: |h, p| format!("{h}:{p}"),
};

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
            }
        }
    };
    if json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        demo::print_table(&summary);
    }
    Ok(code)
}

/// A fabric for a multi-process role: the in-process one cannot cross processes.
fn cross_process(kind: FabricKind) -> anyhow::Result<FabricKind> {
    anyhow::ensure!(
        kind != FabricKind::Mem,
        "--fabric mem works only inside one process (kvx demo); use tcp or shm"
    );
    Ok(kind)
}

pub async fn receiver(args: ReceiverArgs) -> anyhow::Result<ExitCode> {
    match cross_process(args.fabric)? {
        FabricKind::Shm => {
            roles::receiver(TokioEnv::new(zmq()?, ShmFabric::new()), ZMQ_STYLE, args).await
        }
        _ => roles::receiver(TokioEnv::new(zmq()?, TcpFabric::new()), ZMQ_STYLE, args).await,
    }
}

pub async fn sender(args: SenderArgs) -> anyhow::Result<ExitCode> {
    match cross_process(args.fabric)? {
        FabricKind::Shm => {
            roles::sender(TokioEnv::new(zmq()?, ShmFabric::new()), ZMQ_STYLE, args).await
        }
        _ => roles::sender(TokioEnv::new(zmq()?, TcpFabric::new()), ZMQ_STYLE, args).await,
    }
}

pub async fn proxy(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    // The proxy moves no KV bytes; any fabric type will do for its environment.
    roles::proxy(TokioEnv::new(zmq()?, MemFabric::new()), ZMQ_STYLE, args).await
}
