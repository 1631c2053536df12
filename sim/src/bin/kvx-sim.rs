//! The swarm runner: `kvx-sim --seeds N [--start S] [--faults] [--break VARIANT]`.
//! Each seed draws a topology, a workload and fault knobs (`kvx_sim::plan`), runs, and is
//! checked. A failing seed prints the one command that replays it. Exits non-zero on any
//! failure (so `--break` runs are expected to exit non-zero: the variant was caught).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvx_proto::broken_variants::Variant;
use kvx_sim::known_bugs::KnownBug;
use kvx_sim::{plan, run, RunOptions, RunReport};

/// A seed still running after this much wall time is reported as hung.
const HUNG_AFTER: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
struct Args {
    seeds: u64,
    start: u64,
    faults: bool,
    variant: Option<Variant>,
    trace: bool,
    determinism: bool,
    jobs: usize,
    first: bool,
    expose: Vec<KnownBug>,
    /// Do not stop at the first failure even with `--break` (to count how often it is caught).
    keep_going: bool,
}

fn usage() -> &'static str {
    "usage: kvx-sim [--seeds N] [--start S] [--faults] [--break VARIANT] [--trace] [--determinism] [--jobs J] [--first] [--keep-going] [--expose BUG]\n\
     variants: no-reservation release-before-complete stage-before-admit lock-across-admission no-cancel-release reuse-slot-early no-pending-flush\n\
     known bugs (worked around unless exposed): tp-admission-cycle"
}

fn parse() -> Result<Args> {
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut a = Args {
        seeds: 100,
        start: 0,
        faults: false,
        variant: None,
        trace: false,
        determinism: false,
        jobs,
        first: false,
        expose: Vec::new(),
        keep_going: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .with_context(|| format!("{name} needs a value\n{}", usage()))
        };
        match arg.as_str() {
            "--seeds" => a.seeds = value("--seeds")?.parse()?,
            "--start" => a.start = value("--start")?.parse()?,
            "--jobs" => a.jobs = value("--jobs")?.parse::<usize>()?.max(1),
            "--break" => {
                let name = value("--break")?;
                a.variant = Some(
                    Variant::from_name(&name)
                        .with_context(|| format!("unknown variant {name}\n{}", usage()))?,
                );
                a.first = true;
            }
            "--expose" => {
                let name = value("--expose")?;
                a.expose.push(
                    KnownBug::from_name(&name)
                        .with_context(|| format!("unknown known bug {name}\n{}", usage()))?,
                );
            }
            "--faults" => a.faults = true,
            "--trace" => a.trace = true,
            "--determinism" => a.determinism = true,
            "--first" => a.first = true,
            "--keep-going" => a.keep_going = true,
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}\n{}", usage()),
        }
    }
    Ok(a)
}

fn replay(a: &Args, seed: u64) -> String {
    let mut cmd = format!("sim/run.sh --seeds 1 --start {seed}");
    if a.faults {
        cmd += " --faults";
    }
    if let Some(v) = a.variant {
        cmd += &format!(" --break {}", v.name());
    }
    for b in &a.expose {
        cmd += &format!(" --expose {}", b.name());
    }
    cmd + " --trace"
}

/// Runs one seed (twice with `--determinism`, comparing the traces).
fn one(a: &Args, seed: u64) -> RunReport {
    let opts = RunOptions {
        trace: a.trace,
        variant: a.variant,
        expose: a.expose.clone(),
    };
    let mut report = run(plan::random(seed, a.faults), opts.clone());
    if a.determinism {
        let again = run(
            plan::random(seed, a.faults),
            RunOptions {
                trace: false,
                ..opts
            },
        );
        if (again.trace_hash, again.events) != (report.trace_hash, report.events) {
            report.violations.push(format!(
                "G5: the same seed gave two traces: {:016x} ({} events) and {:016x} ({} events)",
                report.trace_hash, report.events, again.trace_hash, again.events
            ));
        }
    }
    report
}

fn main() -> Result<()> {
    let a = parse()?;
    // A failing run's panic is reported with its seed below; the default hook's text would
    // only repeat it (and madsim prints the task's context anyway).
    if !a.trace {
        std::panic::set_hook(Box::new(|_| {}));
    }
    let began = Instant::now();
    let next = Arc::new(AtomicU64::new(a.start));
    let end = a.start + a.seeds;
    let (tx, rx) = mpsc::channel::<(u64, RunReport)>();
    let (started_tx, started_rx) = mpsc::channel::<u64>();
    for _ in 0..a.jobs.min(a.seeds.max(1) as usize) {
        let (a, next, tx, started_tx) = (a.clone(), next.clone(), tx.clone(), started_tx.clone());
        std::thread::spawn(move || loop {
            let seed = next.fetch_add(1, Ordering::Relaxed);
            if seed >= end {
                return;
            }
            let _ = started_tx.send(seed);
            if tx.send((seed, one(&a, seed))).is_err() {
                return;
            }
        });
    }
    drop(tx);
    let (mut done, mut failed, mut events, mut requests, mut delivered) =
        (0u64, Vec::new(), 0u64, 0usize, 0usize);
    let mut running = BTreeSet::new();
    let mut caught_by = std::collections::BTreeMap::new();
    loop {
        while let Ok(seed) = started_rx.try_recv() {
            running.insert(seed);
        }
        let (seed, report) = match rx.recv_timeout(HUNG_AFTER) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                while let Ok(seed) = started_rx.try_recv() {
                    running.insert(seed);
                }
                eprintln!("HUNG: seeds {running:?} ran past {HUNG_AFTER:?} of wall time");
                for s in &running {
                    eprintln!("  replay: {}", replay(&a, *s));
                }
                std::process::exit(2);
            }
        };
        running.remove(&seed);
        done += 1;
        events += report.events;
        requests += report.requests;
        delivered += report.delivered;
        if !report.passed() {
            *caught_by
                .entry(label(&report.violations[0]))
                .or_insert(0u64) += 1;
            print_failure(&a, &report, failed.is_empty());
            failed.push(seed);
            if a.first && !a.keep_going {
                break;
            }
        }
    }
    let wall = began.elapsed().as_secs_f64();
    println!(
        "kvx-sim: {done} seeds from {} ({}{}), {} failed; {events} events, {requests} requests, {delivered} ready; {wall:.1} s, {:.1} seeds/s",
        a.start,
        if a.faults { "faults" } else { "no faults" },
        a.variant.map(|v| format!(", broken: {}", v.name())).unwrap_or_default(),
        failed.len(),
        done as f64 / wall.max(1e-9)
    );
    if !caught_by.is_empty() {
        let by: Vec<String> = caught_by.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
        println!("first violation per failing seed: {}", by.join(", "));
    }
    if !failed.is_empty() {
        let shown: Vec<String> = failed.iter().take(20).map(|s| s.to_string()).collect();
        println!("failing seeds: {}", shown.join(" "));
        std::process::exit(1);
    }
    if done != a.seeds {
        // A worker that died without reporting (a panic outside a run's own catch) leaves
        // seeds that never ran: a sweep that checked less than it was asked to is no pass.
        println!(
            "kvx-sim: ran {done} of the {} seeds asked for: failing (a worker ended early)",
            a.seeds
        );
        std::process::exit(3);
    }
    Ok(())
}

fn print_failure(a: &Args, r: &RunReport, with_tail: bool) {
    println!(
        "FAIL seed {}: {}",
        r.seed,
        r.violations.first().map_or("?", |v| v.as_str())
    );
    for v in r.violations.iter().skip(1).take(5) {
        println!("  also: {v}");
    }
    if with_tail && !a.trace {
        println!("  last events:");
        for line in r.tail.iter().rev().take(25).rev() {
            println!("    {line}");
        }
    }
    println!("  replay: {}", replay(a, r.seed));
}

/// The name of the rule a violation broke ("A1", "G4 liveness", or the panic's message).
fn label(v: &str) -> String {
    let v = v.split_once("] ").map_or(v, |(_, rest)| rest);
    if let Some(msg) = v.strip_prefix("panic (stuck or an invariant assertion): ") {
        return format!("panic \"{}\"", msg.chars().take(60).collect::<String>());
    }
    v.split(':').next().unwrap_or(v).to_owned()
}
