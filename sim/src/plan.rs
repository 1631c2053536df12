//! Swarm generation (TigerBeetle's VOPR style): one seed draws a whole run — topology, every
//! node's sizes, the timing of the world, the workload, and which fault knobs are on and how
//! hard. Each knob is on for only some seeds, so that rare combinations get their turn.

use std::time::Duration;

use kvx_proto::config::{Pipelining, Placement};
use kvx_proto::rng::SeededRng;

use crate::config::{receiver_node, sender_node, Fault, FaultEvent, RequestPlan, SimConfig};

const MS: Duration = Duration::from_millis(1);

/// Draws the run of `seed`. Without `faults` nothing is injected and every request (except
/// oversized ones) must be delivered; with it, faults and aborts hit a first phase, then
/// everything heals and a second phase must be delivered in full.
pub fn random(seed: u64, faults: bool) -> SimConfig {
    let mut rng = SeededRng::new(seed);
    let mut cfg = SimConfig::new(rng.range(1, 3) as usize, rng.range(1, 3) as usize, 1, 1);
    cfg.seed = seed;
    cfg.tp = if rng.chance(0.25) { 2 } else { 1 };
    // Per-sender shares half the time, from half of the buffer to all of it, drawn from a
    // generator of their own so that every other draw of a seed stays what it was. Requests
    // are sized against the buffer alone: shares decide order, never what is served.
    let mut shares = SeededRng::new(seed ^ 0x5AA2_E5EE_D000);
    for d in &mut cfg.decode {
        d.receiver.buffer_slots = rng.range_u32(4, 40);
        if shares.chance(0.5) {
            d.receiver.peer_share_percent = shares.range_u32(50, 100);
        }
    }
    // The decoders' intake, from a generator of its own (every other draw stays the seed's).
    cfg.decoder_takes_leases = SeededRng::new(seed ^ 0x1EA5_E5DE_C0DE).chance(0.5);
    // Caller staging for some engines (a vLLM prefill engine's own KV), from a generator of
    // its own too; its slots are sized once the requests are drawn (below).
    let mut staging = SeededRng::new(seed ^ 0xCA11_E125_7A61);
    for p in &mut cfg.prefill {
        if staging.chance(0.5) {
            p.sender.staging_placement = Placement::Caller;
        }
    }
    for p in &mut cfg.prefill {
        p.sender.staging_slots = rng.range_u32(1, 24);
        p.sender.inflight_max = rng.range(1, 16) as usize;
        if rng.chance(0.3) {
            p.sender.pipelining = Pipelining::Off;
        }
        p.interleave = rng.range(1, 4) as usize;
        p.allocate_first = rng.chance(0.5);
    }
    cfg.chunk_bytes = *rng.pick(&[64, 128, 256, 512]);
    // madsim's timers sleep at least 1 ms: the world's timing is drawn at that scale.
    cfg.prefill_chunk_time = if rng.chance(0.5) {
        Duration::ZERO
    } else {
        rng.duration(MS, 3 * MS)
    };
    cfg.decode_delay = rng.duration(MS, 5 * MS);
    cfg.model.control_latency_min = rng.duration(MS, 3 * MS);
    cfg.model.control_latency_max =
        cfg.model.control_latency_min + rng.duration(Duration::ZERO, 5 * MS);
    cfg.model.fabric_latency = rng.duration(MS, 2 * MS);
    cfg.model.egress_bytes_per_sec = rng.range(1, 20) * 1_000_000_000;
    timeouts(&mut rng, &mut cfg);

    // Short bursts, or load sustained past the leases and quarantines that faults start.
    let window = if rng.chance(0.5) {
        rng.duration(5 * MS, 800 * MS)
    } else {
        rng.duration(800 * MS, 4_000 * MS)
    };
    let first = rng.range(3, 24) + window.as_millis() as u64 / 200;
    for i in 0..first {
        let start_at = 20 * MS + rng.duration(Duration::ZERO, window);
        let plan = request(&mut rng, &cfg, format!("a{i}"), start_at);
        cfg.requests.push(plan);
    }
    size_caller_staging(&mut cfg);
    if !faults {
        return cfg;
    }
    let cancels = rng.chance(0.5);
    for plan in &mut cfg.requests {
        plan.fault_free = false;
        if cancels && rng.chance(0.3) {
            plan.cancel_after = Some(rng.duration(Duration::ZERO, 3 * MS));
        }
    }
    let end = 20 * MS + window;
    cfg.faults = faults_for(&mut rng, &cfg, end);
    let fault_end = cfg
        .faults
        .iter()
        .map(|f| f.at + lasts(&f.fault))
        .max()
        .unwrap_or_default();
    cfg.heal_at = end.max(fault_end) + 10 * MS;
    let from = cfg.heal_at + cfg.settle();
    for i in 0..rng.range(2, 12) {
        let start_at = from + rng.duration(Duration::ZERO, 50 * MS);
        let plan = request(&mut rng, &cfg, format!("b{i}"), start_at);
        cfg.requests.push(plan);
    }
    size_caller_staging(&mut cfg);
    cfg
}

fn request(rng: &mut SeededRng, cfg: &SimConfig, id: String, start_at: Duration) -> RequestPlan {
    let prefill = rng.range(0, cfg.prefill.len() as u64 - 1) as usize;
    let decode = rng.range(0, cfg.decode.len() as u64 - 1) as usize;
    let receiver = &cfg.decode[decode].receiver;
    let buffer = receiver.buffer_slots;
    // Up to the whole buffer, whatever the share: a request that fits is served, and one
    // larger than its sender's share goes in when its sender holds nothing (§Fair shares).
    let most = buffer;
    // Large requests half the time: contention is where admission bugs live.
    let chunks = if rng.chance(0.5) {
        rng.range_u32(most.div_ceil(2), most)
    } else {
        rng.range_u32(1, most.min(8))
    };
    let mut plan = RequestPlan::new(&id, prefill, decode, chunks, rng.range_u32(1, 6));
    plan.start_at = start_at;
    if rng.chance(0.05) {
        // LMCache W13: fewer chunks sent than declared.
        plan.declared = (chunks + rng.range_u32(1, 3)).min(most);
    }
    if rng.chance(0.03) {
        plan.declared = buffer + rng.range_u32(1, 4);
        plan.oversized = true;
    }
    plan
}

fn lasts(f: &Fault) -> Duration {
    match f {
        Fault::Disconnect { .. } => Duration::ZERO,
        Fault::Partition { lasts, .. } | Fault::Crash { lasts, .. } => *lasts,
        Fault::Pause { lasts, .. } | Fault::Slow { lasts, .. } => *lasts,
    }
}

/// Each kind of fault is on for about half the seeds, with a random count and strength.
fn faults_for(rng: &mut SeededRng, cfg: &SimConfig, end: Duration) -> Vec<FaultEvent> {
    let senders: Vec<String> = (0..cfg.prefill.len())
        .flat_map(|p| (0..cfg.tp).map(move |r| sender_node(p, r)))
        .collect();
    let receivers: Vec<String> = (0..cfg.decode.len())
        .flat_map(|d| (0..cfg.tp).map(move |r| receiver_node(d, r)))
        .collect();
    let mut out = Vec::new();
    let at = |rng: &mut SeededRng| rng.duration(10 * MS, end.max(20 * MS));
    if rng.chance(0.5) {
        for _ in 0..rng.range(1, 4) {
            let (a, b) = (rng.pick(&senders).clone(), rng.pick(&receivers).clone());
            out.push(FaultEvent {
                at: at(rng),
                fault: Fault::Disconnect { a, b },
            });
        }
    }
    if rng.chance(0.4) {
        for _ in 0..rng.range(1, 2) {
            let (a, b) = (rng.pick(&senders).clone(), rng.pick(&receivers).clone());
            let lasts = rng.duration(10 * MS, 1_000 * MS);
            out.push(FaultEvent {
                at: at(rng),
                fault: Fault::Partition { a, b, lasts },
            });
        }
    }
    if rng.chance(0.4) {
        for _ in 0..rng.range(1, 2) {
            let node = rng.pick(&senders).clone();
            let lasts = rng.duration(10 * MS, 800 * MS);
            out.push(FaultEvent {
                at: at(rng),
                fault: Fault::Crash { node, lasts },
            });
        }
    }
    if rng.chance(0.25) {
        let node = rng.pick(&receivers).clone();
        let lasts = rng.duration(10 * MS, 800 * MS);
        out.push(FaultEvent {
            at: at(rng),
            fault: Fault::Crash { node, lasts },
        });
    }
    if rng.chance(0.4) {
        // A hung prefill process whose NIC is slow too: its writes land late, after its
        // receiver may have given up on the request (the quarantine's reason to exist).
        for _ in 0..rng.range(1, 2) {
            let node = rng.pick(&senders).clone();
            let (when, lasts) = (at(rng), rng.duration(100 * MS, 3_000 * MS));
            let extra = rng.duration(500 * MS, 2_500 * MS);
            for b in &receivers {
                let fault = Fault::Slow {
                    a: node.clone(),
                    b: b.clone(),
                    extra,
                    lasts,
                    fabric_only: true,
                };
                out.push(FaultEvent { at: when, fault });
            }
            out.push(FaultEvent {
                at: when + MS,
                fault: Fault::Pause { node, lasts },
            });
        }
    }
    if rng.chance(0.4) {
        for _ in 0..rng.range(1, 3) {
            let (a, b) = (rng.pick(&senders).clone(), rng.pick(&receivers).clone());
            let (extra, lasts) = (
                rng.duration(MS, 2_000 * MS),
                rng.duration(10 * MS, 1_000 * MS),
            );
            let fabric_only = rng.chance(0.5);
            out.push(FaultEvent {
                at: at(rng),
                fault: Fault::Slow {
                    a,
                    b,
                    extra,
                    lasts,
                    fabric_only,
                },
            });
        }
    }
    out.sort_by_key(|f| f.at);
    out
}

/// Timeouts drawn per seed within the rules that tie them together
/// (`ReceiverConfig::check_sender`): a live sender's write ends before the receiver's lease
/// on the request and its quarantine of the slots, and a grant acted on within
/// `reply_timeout` is written or flushed before lease + quarantine run out. The fabric's own
/// give-up time (a hung sender cannot reset its connection) is the sender's write timeout.
fn timeouts(rng: &mut SeededRng, cfg: &mut SimConfig) {
    let write_timeout = rng.duration(200 * MS, 1_000 * MS);
    let reply_timeout = rng.duration(300 * MS, 1_500 * MS);
    let idle = write_timeout + rng.duration(200 * MS, 2_000 * MS);
    let floor = (reply_timeout + write_timeout)
        .saturating_sub(idle)
        .max(write_timeout);
    let quarantine = floor + rng.duration(200 * MS, 3_000 * MS);
    for p in &mut cfg.prefill {
        p.sender.write_timeout = write_timeout;
        p.sender.reply_timeout = reply_timeout;
    }
    for d in &mut cfg.decode {
        d.receiver.request_idle_timeout = idle;
        d.receiver.write_quarantine = quarantine;
    }
    // Real NICs give up long before kvx's write timeout (it only has to bound the write).
    cfg.model.qp_retry_timeout = rng.duration(write_timeout / 4, write_timeout);
}

/// An engine with caller staging holds a request's slots from its first chunk until the
/// request reads none of them (as a vLLM engine holds a request's blocks): it has room for
/// `interleave` requests of the largest declared size at once, as an engine's KV cache is
/// sized for the requests it runs.
fn size_caller_staging(cfg: &mut SimConfig) {
    for (p, worker) in cfg.prefill.iter_mut().enumerate() {
        if worker.sender.staging_placement != Placement::Caller {
            continue;
        }
        let largest = cfg
            .requests
            .iter()
            .filter(|r| r.prefill == p)
            .map(|r| r.declared)
            .max()
            .unwrap_or(1);
        worker.sender.staging_slots = largest * worker.interleave as u32;
    }
}
