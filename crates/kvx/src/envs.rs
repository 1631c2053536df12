//! From the command line's `--transport`/`--fabric` to an environment: the flags become a
//! `kvx_embed::EnvChoice`, whose `into_env` (the one `match` over implementations) makes the
//! `AnyEnv` the demo or role runs on.

use std::process::ExitCode;

use kvx_embed::{EnvChoice, FabricChoice, InProcess, TransportChoice};
use kvx_io::mem::MemFabric;
use kvx_transport::zmq::{CurveConfig, ZmqConfig};

use crate::cli::{
    DemoArgs, FabricKind, ProxyArgs, RdmaArgs, ReceiverArgs, SenderArgs, TransportKind,
};
use crate::demo::{self, Endpoints};
use crate::roles::{self, Style};

const ZMQ_STYLE: Style = Style {
    control: |h, p| format!("tcp://{h}:{p}"),
    fabric: |h, p| format!("{h}:{p}"),
};

/// The choice the flags make, through `kvx_embed::named` (the mapping Python uses too).
/// In-process parts share one `InProcess`. `curve`: the ZMQ transport's CURVE settings
/// (`--curve-*`), `None` for NULL.
fn choice(
    transport: TransportKind,
    fabric: FabricKind,
    rdma: &RdmaArgs,
    curve: Option<CurveConfig>,
) -> anyhow::Result<EnvChoice> {
    let in_process = InProcess::new();
    if fabric == FabricKind::Rdma {
        // The RDMA settings come from their flags (and a build without RDMA says how to
        // get one).
        return Ok(EnvChoice {
            transport: TransportChoice::named(&value_name(transport), curve, &in_process)?,
            fabric: rdma_choice(rdma)?,
        });
    }
    Ok(EnvChoice::named(
        &value_name(transport),
        &value_name(fabric),
        curve,
        &in_process,
    )?)
}

/// The name a flag's value goes by on the command line (clap's `ValueEnum`).
fn value_name(kind: impl clap::ValueEnum) -> String {
    kind.to_possible_value()
        .map(|v| v.get_name().to_owned())
        .expect("invariant: every kind has a name on the command line")
}

/// The RDMA fabric on the configured device.
#[cfg(feature = "rdma")]
fn rdma_choice(args: &RdmaArgs) -> anyhow::Result<FabricChoice> {
    Ok(FabricChoice::Rdma(rdma_config(args)?))
}

/// The RDMA settings the flags give (the device is opened when the fabric is made: without
/// one, or without libibverbs, an error that says "no RDMA device found").
#[cfg(feature = "rdma")]
pub fn rdma_config(args: &RdmaArgs) -> anyhow::Result<kvx_rdma::RdmaConfig> {
    Ok(kvx_rdma::RdmaConfig {
        device: args.rdma_device.clone(),
        port: args.rdma_port,
        gid_index: args.rdma_gid_index,
        mtu: match args.rdma_mtu {
            Some(m) => Some(m.to_string().parse().map_err(anyhow::Error::msg)?),
            None => None,
        },
        ..kvx_rdma::RdmaConfig::default()
    })
}

/// The RDMA fabric itself, opened now (`kvx bench`, which drives a fabric directly).
#[cfg(feature = "rdma")]
pub fn rdma(args: &RdmaArgs) -> anyhow::Result<kvx_rdma::IbvFabric> {
    Ok(kvx_rdma::RdmaFabric::open(rdma_config(args)?)?)
}

/// This build has no RDMA backend: say how to get one.
#[cfg(not(feature = "rdma"))]
pub fn rdma(_: &RdmaArgs) -> anyhow::Result<std::convert::Infallible> {
    anyhow::bail!(
        "--fabric rdma: this kvx was built without RDMA support; rebuild it with \
         `cargo build --release -p kvx --features rdma` (needs cmake and libclang; see docs/operations.md)"
    )
}

#[cfg(not(feature = "rdma"))]
fn rdma_choice(args: &RdmaArgs) -> anyhow::Result<FabricChoice> {
    match rdma(args)? {}
}

/// A fabric for a multi-process role: the in-process one cannot cross processes.
fn cross_process(kind: FabricKind) -> anyhow::Result<FabricKind> {
    anyhow::ensure!(
        kind != FabricKind::Mem,
        "--fabric mem works only inside one process (kvx demo); use tcp, shm or rdma"
    );
    Ok(kind)
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let json = args.workload.json;
    let choice = choice(args.transport, args.fabric, &args.rdma, None)?;
    let (transport_name, fabric_name) = choice.names();
    let in_process = matches!(choice.transport, TransportChoice::Mem(_));
    let endpoints = Endpoints {
        transport_name: transport_name.into(),
        fabric_name: fabric_name.into(),
        alloc: if in_process {
            "alloc"
        } else {
            "tcp://127.0.0.1:0"
        }
        .into(),
        proxy: if in_process {
            "proxy"
        } else {
            "tcp://127.0.0.1:0"
        }
        .into(),
        fabric: if matches!(choice.fabric, FabricChoice::Mem(_)) {
            "buffer"
        } else {
            "127.0.0.1:0"
        }
        .into(),
    };
    let (summary, code) = demo::run_on(choice.into_env()?, endpoints, args).await?;
    if json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        demo::print_table(&summary);
    }
    Ok(code)
}

pub async fn receiver(args: ReceiverArgs) -> anyhow::Result<ExitCode> {
    let fabric = cross_process(args.fabric)?;
    let mut choice = choice(TransportKind::Zmq, fabric, &args.rdma, args.curve.load()?)?;
    args.heartbeats.apply(&mut choice)?;
    roles::receiver(choice.into_env()?, ZMQ_STYLE, args).await
}

pub async fn sender(args: SenderArgs) -> anyhow::Result<ExitCode> {
    let fabric = cross_process(args.fabric)?;
    let mut choice = choice(TransportKind::Zmq, fabric, &args.rdma, args.curve.load()?)?;
    args.heartbeats.apply(&mut choice)?;
    roles::sender(choice.into_env()?, ZMQ_STYLE, args).await
}

pub async fn proxy(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    // The proxy moves no KV bytes; the in-process fabric will do for its environment.
    let choice = EnvChoice {
        transport: TransportChoice::Zmq(ZmqConfig {
            curve: args.curve.load()?.map(Box::new),
            ..ZmqConfig::default()
        }),
        fabric: FabricChoice::Mem(MemFabric::new()),
    };
    roles::proxy(choice.into_env()?, ZMQ_STYLE, args).await
}

/// `kvx keygen`: a fresh key pair written as certificates; prints where, and the public key.
pub fn keygen(args: &crate::cli::KeygenArgs) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let keys = kvx_transport::zmq::CurveKeyPair::generate();
    let (public, secret) = keys.write_certificates(&args.dir, &args.name)?;
    println!("public key {}", keys.public_z85());
    println!("wrote {} (public: hand it to peers)", public.display());
    println!(
        "wrote {} (secret, mode 0600: keep it here)",
        secret.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    /// The flags offer exactly the names `kvx_embed::named` maps: no second spelling.
    #[test]
    fn the_flags_offer_the_names_kvx_embed_maps() {
        let transports: Vec<String> = TransportKind::value_variants()
            .iter()
            .map(|k| value_name(*k))
            .collect();
        assert_eq!(transports, kvx_embed::TRANSPORT_NAMES);
        let fabrics: Vec<String> = FabricKind::value_variants()
            .iter()
            .map(|k| value_name(*k))
            .collect();
        assert_eq!(fabrics, kvx_embed::FABRIC_NAMES);
    }
}
