//! Picking a transport and fabric at runtime. Drivers are generic over `Env`; this module is
//! the one place that names concrete implementations, with a `match`, not `dyn`.

use std::process::ExitCode;

use kvx_io::mem::{MemFabric, MemTransport};
use kvx_io::TokioEnv;

use crate::cli::{DemoArgs, FabricKind, TransportKind};
use crate::demo;

/// Where the demo's parts listen (port 0: the OS picks).
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub transport_name: String,
    pub fabric_name: String,
    pub alloc: String,
    pub proxy: String,
    pub fabric: String,
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let json = args.json;
    let (summary, code) = match (args.transport, args.fabric) {
        (TransportKind::Mem, FabricKind::Mem) => {
            let endpoints = Endpoints {
                transport_name: "mem".into(),
                fabric_name: "mem".into(),
                alloc: "alloc".into(),
                proxy: "proxy".into(),
                fabric: "buffer".into(),
            };
            demo::run_on(
                TokioEnv::new(MemTransport::new(), MemFabric::new()),
                endpoints,
                args,
            )
            .await?
        }
        (t, f) => {
            anyhow::bail!("the combination --transport {t:?} --fabric {f:?} is not available yet")
        }
    };
    if json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        demo::print_table(&summary);
    }
    Ok(code)
}
