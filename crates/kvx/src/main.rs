//! The `kvx` command. `kvx demo` runs a whole cluster in one process; `kvx receiver`,
//! `kvx sender` and `kvx proxy` run its parts as separate processes; `kvx bench` measures a
//! fabric; `kvx wire` decodes and encodes messages.
//!
//! Map:
//! - `cli`: the clap definitions (every flag's help text).
//! - `demo`: the demo and its summary.
//! - `decoder`: the synthetic decoder of `demo` and `receiver` (a task per ready request).
//! - `workload`: the seeded plan of synthetic requests.
//! - `loadgen`: prefill workers that run a plan on every TP rank and tally outcomes.
//! - `wire_cmd`: `kvx wire decode|encode`.
//! - `envs`: picking a transport and fabric at runtime.
//! - `roles`: `kvx receiver`, `kvx sender`, `kvx proxy`.
//! - `signals`: how they stop (SIGINT, SIGTERM; a second one exits at once).
//! - `config`: their TOML file.
//! - `health`: their `--metrics` server: `/metrics` and `/ready`.
//! - `knobs`: every protocol setting of each role as a flag (and TOML key).
//! - `lmcache_config`: their `--lmcache-config`, the `pd_*` keys of an LMCache YAML file.
//! - `bench`: `kvx bench`, fabric throughput against a same-run baseline.

mod bench;
mod cli;
mod config;
mod decoder;
mod demo;
mod envs;
mod health;
mod knobs;
mod lmcache_config;
mod loadgen;
mod memory_check;
mod roles;
mod signals;
mod wire_cmd;
mod workload;

use std::process::ExitCode;

use clap::Parser;

/// Raises the soft limit on open files to the hard one. Services hold a socket per peer (the
/// ZMQ sockets and fabric listeners cap their connections at 1024 and 256); with the common
/// soft limit of 1024, a flood of connections could exhaust descriptors before those caps
/// apply, and starve the fabric of sockets.
fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::debug!(error = %e, "cannot raise the open-files limit");
        }
    }
}

fn main() -> ExitCode {
    // A `--config` file's settings join the command line as flags (config.rs).
    let argv = match config::command_line(std::env::args_os().collect()) {
        Ok(argv) => argv,
        Err(e) => {
            eprintln!("kvx: error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let cli = cli::Cli::parse_from(argv);
    // One-shot runs (demo, bench) tear their own connections down at the end, which the
    // fabric logs as broken connections: keep their default quiet; services log warnings.
    let default_filter = match cli.command {
        cli::Command::Demo(_) | cli::Command::Bench(_) | cli::Command::BenchServe(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    raise_open_files_limit();
    let result = match cli.command {
        cli::Command::Wire(args) => wire_cmd::run(args),
        cli::Command::Keygen(args) => envs::keygen(&args),
        cli::Command::Demo(args) => runtime().and_then(|rt| rt.block_on(envs::demo(args))),
        cli::Command::Receiver(args) => runtime().and_then(|rt| rt.block_on(envs::receiver(args))),
        cli::Command::Sender(args) => runtime().and_then(|rt| rt.block_on(envs::sender(args))),
        cli::Command::Proxy(args) => runtime().and_then(|rt| rt.block_on(envs::proxy(args))),
        cli::Command::Bench(args) => runtime().and_then(|rt| rt.block_on(bench::run(args))),
        cli::Command::BenchServe(args) => runtime().and_then(|rt| rt.block_on(bench::serve(args))),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvx: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}
