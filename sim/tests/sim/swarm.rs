//! The swarm as tests: a short sweep with and without faults, the same seed giving the same
//! trace, every deliberately broken variant caught within 200 seeds, and every known kvx bug
//! (docs/sim.md §Findings) still reproducing when its workaround is off — when one of these
//! starts to pass, the bug was fixed: remove its workaround.

use std::time::Duration;

use kvx_proto::broken_variants::Variant;
use kvx_sim::config::{Fault, FaultEvent};
use kvx_sim::known_bugs::KnownBug;
use kvx_sim::{plan, run, RequestPlan, RunOptions, SimConfig};

use crate::scenarios::passes;

const MS: Duration = Duration::from_millis(1);

#[test]
fn short_sweep() {
    for seed in 0..40 {
        for faults in [false, true] {
            let r = run(plan::random(seed, faults), RunOptions::default());
            assert!(r.passed(), "seed {seed} faults {faults}: {:#?}\n  replay: sim/run.sh --seeds 1 --start {seed}{}", r.violations, if faults { " --faults" } else { "" });
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    for seed in [3, 17, 40] {
        let a = run(plan::random(seed, true), RunOptions::default());
        let b = run(plan::random(seed, true), RunOptions::default());
        assert!(a.events > 100, "seed {seed} did something");
        assert_eq!(
            (a.trace_hash, a.events),
            (b.trace_hash, b.events),
            "seed {seed}"
        );
    }
}

#[test]
fn every_broken_variant_is_caught_within_200_seeds() {
    for variant in Variant::ALL {
        let opts = RunOptions {
            variant: Some(variant),
            ..RunOptions::default()
        };
        let caught = (0..200).find_map(|seed| {
            let r = run(plan::random(seed, true), opts.clone());
            (!r.passed()).then(|| (seed, r.violations[0].clone()))
        });
        let (seed, why) =
            caught.unwrap_or_else(|| panic!("{} was not caught in 200 seeds", variant.name()));
        eprintln!("{:<24} caught at seed {seed}: {why}", variant.name());
    }
}

fn fails_only_when_exposed(cfg: SimConfig, bug: KnownBug) {
    let worked_around = run(cfg.clone(), RunOptions::default());
    assert!(worked_around.passed(), "{:#?}", worked_around.violations);
    let exposed = run(
        cfg,
        RunOptions {
            expose: vec![bug],
            ..RunOptions::default()
        },
    );
    assert!(
        !exposed.passed(),
        "{} no longer reproduces: fixed? then remove its workaround",
        bug.name()
    );
    eprintln!("{:<20} {}", bug.name(), exposed.violations[0]);
}

/// A slowdown of `a` ~ `b` from `at`: of writes only (`fabric_only`), or of everything.
fn slow(
    a: &str,
    b: &str,
    extra: Duration,
    lasts: Duration,
    at: Duration,
    fabric_only: bool,
) -> FaultEvent {
    let (a, b) = (a.into(), b.into());
    let fault = Fault::Slow {
        a,
        b,
        extra,
        lasts,
        fabric_only,
    };
    FaultEvent { at, fault }
}

/// TP = 2: X reaches rank 0's receiver first, Y reaches rank 1's first, and each needs the
/// whole buffer of its rank. Admitted in rank order (the protocol's TP rule), both finish;
/// admitted at once, each holds one rank and waits for the other until admission times out.
#[test]
fn tp_ranks_admitted_out_of_order_deadlock() {
    let mut cfg = SimConfig::new(2, 1, 10, 8)
        .with(RequestPlan::new("X", 0, 0, 8, 2))
        .with(RequestPlan::new("Y", 1, 0, 8, 2));
    cfg.tp = 2;
    cfg.faults = vec![
        slow("p0r1", "d0r1", 5 * MS, 100 * MS, Duration::ZERO, false),
        slow("p1r0", "d0r0", 5 * MS, 100 * MS, Duration::ZERO, false),
    ];
    cfg.heal_at = 200 * MS;
    fails_only_when_exposed(cfg, KnownBug::TpAdmissionCycle);
}

// Regressions: bugs the simulation found in kvx, fixed since (docs/sim.md §Findings). Each
// scenario failed before its fix.

/// Staging freed by a write completion did not wake `allocate` (fixed in b5bd3b4): with one
/// staging slot every chunk waited out `staging_timeout`.
#[test]
fn found_allocate_is_woken_by_write_completions() {
    let r = passes(SimConfig::new(1, 1, 10, 1).with(RequestPlan::new("w", 0, 0, 8, 4)));
    let w = &r.outcomes["w"];
    assert!(
        w.proxy_at.unwrap_or_default() - w.begun_at < 100 * MS,
        "{w:?}"
    );
}

/// Admission probes waiting at the receiver filled the pipelined window and held back an
/// admitted request's batches until a lease expired (fixed in e5c8e7f: probes have their own
/// window).
#[test]
fn found_waiting_probes_do_not_block_batches() {
    let mut cfg = SimConfig::new(1, 1, 10, 8).with(RequestPlan::new("A", 0, 0, 8, 1));
    for (id, start) in [("B", 21 * MS), ("C", 22 * MS)] {
        cfg = cfg.with(RequestPlan {
            start_at: start,
            ..RequestPlan::new(id, 0, 0, 8, 1)
        });
    }
    cfg.prefill[0].interleave = 3;
    cfg.prefill[0].sender.inflight_max = 2;
    cfg.prefill_chunk_time = MS;
    passes(cfg);
}

/// A restarted sender that could not reach one receiver gave a later receiver the same peer
/// id: a request meant for d0 was admitted and written by d2 (fixed in e5c8e7f).
#[test]
fn found_peer_ids_are_never_reused() {
    let mut cfg = SimConfig::new(1, 3, 10, 8).with(RequestPlan {
        start_at: 1_000 * MS,
        ..RequestPlan::new("r", 0, 0, 4, 2)
    });
    let crash = Fault::Crash {
        node: "p0r0".into(),
        lasts: 50 * MS,
    };
    let cut = Fault::Partition {
        a: "p0r0".into(),
        b: "d0r0".into(),
        lasts: 300 * MS,
    };
    cfg.faults = vec![
        FaultEvent {
            at: 10 * MS,
            fault: cut,
        },
        FaultEvent {
            at: 11 * MS,
            fault: crash,
        },
    ];
    cfg.heal_at = 400 * MS;
    passes(cfg);
}

/// A sender that hung with a grant on its way wrote it after waking — into slots the
/// receiver had reclaimed and, after the quarantine, given to W (fixed in e5c8e7f: a reply
/// past its deadline is dropped).
#[test]
fn found_stale_grants_are_never_written() {
    let mut z = RequestPlan::new("Z", 0, 0, 8, 4);
    z.fault_free = false;
    let mut cfg = SimConfig::new(2, 1, 8, 8).with(z).with(RequestPlan {
        start_at: 8_000 * MS,
        ..RequestPlan::new("W", 1, 0, 8, 8)
    });
    cfg.decode_delay = 1_000 * MS;
    let hang = Fault::Pause {
        node: "p0r0".into(),
        lasts: 8_000 * MS,
    };
    cfg.faults = vec![
        slow("p0r0", "d0r0", 50 * MS, 300 * MS, 19 * MS, false),
        FaultEvent {
            at: 140 * MS,
            fault: hang,
        },
    ];
    cfg.heal_at = 8_200 * MS;
    let r = passes(cfg);
    assert!(matches!(r.outcomes["Z"].ranks[0].sender, Some(Err(_))));
}

/// The NIC gave up on a slow write (its retry limit is below the sender's write timeout, as
/// with real NICs and kvx's defaults): the fabric connection errored while the control
/// channel stayed up, and the driver never replaced it — every later write to that receiver
/// failed (fixed in 3145311).
#[test]
fn found_an_erroring_fabric_connection_is_replaced() {
    let mut a = RequestPlan::new("A", 0, 0, 4, 4);
    a.fault_free = false;
    let b = RequestPlan {
        start_at: 4_000 * MS,
        ..RequestPlan::new("B", 0, 0, 4, 4)
    };
    let mut cfg = SimConfig::new(1, 1, 10, 8).with(a).with(b);
    cfg.model.qp_retry_timeout = 300 * MS;
    cfg.faults = vec![slow("p0r0", "d0r0", 2_000 * MS, 100 * MS, 10 * MS, true)];
    cfg.heal_at = 200 * MS;
    passes(cfg);
}
