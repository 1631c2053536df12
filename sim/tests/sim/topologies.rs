//! Topologies: 2P1D (transfers overlap: the makespan is close to the longer one), xPyD with
//! random sizes, and tensor parallelism.

use std::time::Duration;

use kvx_proto::rng::SeededRng;
use kvx_sim::{RequestPlan, SimConfig};

use crate::scenarios::{delivered, passes, plan};

const MS: Duration = Duration::from_millis(1);

/// 2P1D: two senders each send one request to one receiver; the transfers overlap, so the
/// makespan is close to the longer one, not the sum.
#[test]
fn two_prefills_transfer_concurrently() {
    let setup = |plans: &[(&str, usize, u32)]| {
        let mut cfg = SimConfig::new(2, 1, 64, 16);
        cfg.chunk_bytes = 1 << 20;
        cfg.model.egress_bytes_per_sec = 1_000_000_000;
        cfg.prefill_chunk_time = Duration::ZERO;
        for &(id, p, chunks) in plans {
            cfg = cfg.with(plan(id, p, chunks, 4));
        }
        let r = passes(cfg);
        let begin = r
            .outcomes
            .values()
            .map(|o| o.begun_at)
            .min()
            .unwrap_or_default();
        r.outcomes
            .values()
            .filter_map(|o| o.proxy_at)
            .max()
            .unwrap_or_default()
            - begin
    };
    let (long, short) = (setup(&[("x", 0, 32)]), setup(&[("x", 0, 24)]));
    let both = setup(&[("a", 0, 32), ("b", 1, 24)]);
    assert!(
        both < (long + short).mul_f64(0.75),
        "makespan {both:?} vs {long:?} + {short:?}"
    );
    assert!(
        both < long.mul_f64(1.2),
        "makespan {both:?} close to the longer {long:?}"
    );
}

/// xPyD: three prefill workers, two decode workers, random sizes and jittery links.
#[test]
fn xpyd_with_random_sizes() {
    for seed in 0..4 {
        let mut rng = SeededRng::new(seed);
        let mut cfg = SimConfig::new(3, 2, 24, 12);
        cfg.seed = seed;
        cfg.model.control_latency_max = 5 * MS;
        for p in &mut cfg.prefill {
            p.interleave = 3;
        }
        for k in 0..18 {
            let mut q = RequestPlan::new(
                &format!("q{k}"),
                k % 3,
                k % 2,
                rng.range_u32(1, 20),
                rng.range_u32(1, 4),
            );
            q.start_at = 20 * MS + rng.duration(Duration::ZERO, 20 * MS);
            cfg = cfg.with(q);
        }
        let r = passes(cfg);
        assert!(r.outcomes.keys().all(|id| delivered(&r, id)), "seed {seed}");
    }
}

/// Tensor parallelism: each of two ranks sends its share to its own receiver; the proxy
/// waits for both, and each rank's decoder reads its own bytes.
#[test]
fn two_tp_ranks_deliver_together() {
    let mut cfg = SimConfig::new(1, 1, 16, 8).with(plan("t", 0, 12, 3));
    cfg.tp = 2;
    let r = passes(cfg);
    assert!(delivered(&r, "t"));
    assert_eq!(r.proxy_notifs.get("t"), Some(&2));
}
