//! Fairness of the receiver's admission, measured in virtual time on the `testing` harness:
//! senders with always a request waiting share one receiver's buffer, and the run's
//! reservations (when each request's slots were reserved, how many, until when) give the
//! buffer's utilization and each sender's slot-seconds. Virtual time makes the figures
//! independent of the machine and of load; the admission rule measured is whatever the
//! receiver ledger runs, with the deployed default `ReceiverConfig` share.
//!
//! Definitions (`docs/PERFORMANCE.md` §Fairness):
//! - the *window* is where demand exceeds supply: from the first reservation to the moment
//!   the first sender begins its last request (until then every sender keeps `interleave`
//!   requests in flight); `backlogged` reports how much of it each sender really had a
//!   request in the admission queue;
//! - a sender's *slot-seconds* are Σ slots × time reserved, clipped to the window;
//! - *utilization* is all slot-seconds / (capacity × window);
//! - *Jain's index* is J = (Σx)² / (n·Σx²) over the senders' slot-seconds x; `J/w` divides
//!   each x by its sender's demand weight first (2 for a sender with twice the demand).

use std::time::Duration;

use kvx_proto::rng::SeededRng;
use kvx_proto::testing::{Cluster, ClusterSpec, End, Report, RequestPlan};
use kvx_proto::ReceiverConfig;
use serde::Serialize;

/// One request's hold on the buffer, in seconds of virtual time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hold {
    /// The sender's index.
    pub sender: usize,
    /// Slots reserved.
    pub slots: u32,
    /// When its first batch entered the admission queue.
    pub queued_at: f64,
    /// When its slots were reserved.
    pub reserved_at: f64,
    /// When its reservation was given back.
    pub released_at: f64,
}

/// What the reservations of a run come to over a window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measures {
    /// Reserved slot-seconds / (capacity × window).
    pub utilization: f64,
    /// Per sender: slots × seconds reserved within the window.
    pub slot_seconds: Vec<f64>,
    /// Per sender: the part of the window it had a request in the admission queue.
    pub backlogged: Vec<f64>,
    /// Per sender: the most slots it held while another sender had a request waiting
    /// (0 when that never happened).
    pub peak_while_others_wait: Vec<u32>,
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one has everything. An
/// empty or all-zero `x` is taken as fair (1).
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (x.len() as f64 * squares)
}

/// Sweeps the holds over `[start, end)`: between consecutive events every sender's footprint
/// and waiting count are constant, so each stretch adds footprint × length to the integrals.
pub fn measure(holds: &[Hold], senders: usize, capacity: u32, start: f64, end: f64) -> Measures {
    // (time, sender, change in slots held, change in requests waiting)
    let mut events: Vec<(f64, usize, i64, i64)> = Vec::with_capacity(holds.len() * 3);
    for h in holds {
        events.push((h.queued_at, h.sender, 0, 1));
        events.push((h.reserved_at, h.sender, i64::from(h.slots), -1));
        events.push((h.released_at, h.sender, -i64::from(h.slots), 0));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut held = vec![0i64; senders];
    let mut waiting = vec![0i64; senders];
    let mut m = Measures {
        utilization: 0.0,
        slot_seconds: vec![0.0; senders],
        backlogged: vec![0.0; senders],
        peak_while_others_wait: vec![0; senders],
    };
    let length = end - start;
    for (k, &(t, who, dh, dw)) in events.iter().enumerate() {
        held[who] += dh;
        waiting[who] += dw;
        let next = events.get(k + 1).map_or(end, |e| e.0);
        // A stretch of no length (more changes at the same instant follow) counts nothing:
        // a release and a reservation at one instant are not a moment with both held.
        let dt = next.min(end) - t.max(start);
        if dt <= 0.0 {
            continue;
        }
        for s in 0..senders {
            m.slot_seconds[s] += held[s] as f64 * dt;
            if waiting[s] > 0 {
                m.backlogged[s] += dt;
            }
            let others_wait = (0..senders).any(|o| o != s && waiting[o] > 0);
            if others_wait {
                let p = &mut m.peak_while_others_wait[s];
                *p = (*p).max(held[s] as u32);
            }
        }
    }
    if length > 0.0 {
        let total: f64 = m.slot_seconds.iter().sum();
        m.utilization = total / (f64::from(capacity) * length);
        for b in &mut m.backlogged {
            *b /= length;
        }
    }
    m
}

/// The workload every case shares.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// Slots in the receiver's buffer.
    pub buffer_slots: u32,
    /// A request's chunks are drawn uniformly from this range (both ends included).
    pub chunks: (u32, u32),
    /// Requests each sender keeps in flight (the prefill engine's interleave).
    pub interleave: usize,
    /// Requests per sender.
    pub requests: usize,
    /// Chunks per submitted batch.
    pub batch_chunks: u32,
    /// Staging slots per sender.
    pub staging_slots: u32,
    /// Time one chunk's write takes on its sender's connection, µs.
    pub write_us: u64,
    /// Time from a request being ready to the decoder consuming it, µs.
    pub decode_delay_us: u64,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            buffer_slots: 64,
            chunks: (4, 16),
            // 8 requests of 10 chunks on average: 80 slots of demand per sender, more than
            // the whole buffer, so even a lone sender always has a request waiting.
            interleave: 8,
            requests: 300,
            batch_chunks: 4,
            staging_slots: 16,
            write_us: 100,
            decode_delay_us: 5_000,
        }
    }
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    /// Its name in the table.
    pub name: String,
    /// Senders contending.
    pub senders: usize,
    /// Sender 0's requests are twice as large as the others'.
    pub heavy: bool,
    /// `peer_share_percent`; `None`: the deployed default.
    pub share_percent: Option<u32>,
    /// Every request has this many chunks instead of `Setup::chunks`' range.
    pub fixed_chunks: Option<u32>,
}

/// The goal a case is held to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", content = "min")]
pub enum Goal {
    /// Utilization at least this.
    Utilization(f64),
    /// Jain's index at least this.
    Jain(f64),
    /// The heavy sender holds at most its share while another sender waits.
    HeavyWithinShare,
}

/// A case's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The case measured.
    pub case: Case,
    /// Slots one sender may hold while others contend (`ReceiverConfig::peer_slots_max`).
    pub share_slots: u32,
    /// Window length, seconds of virtual time.
    pub window_s: f64,
    /// Requests delivered and consumed / planned.
    pub delivered: usize,
    /// Requests planned.
    pub planned: usize,
    /// The sweep's figures.
    pub measures: Measures,
    /// Each sender's part of all slot-seconds.
    pub split: Vec<f64>,
    /// Jain's index of the slot-seconds.
    pub jain: f64,
    /// Jain's index of slot-seconds divided by demand weight.
    pub jain_weighted: f64,
    /// What the case is held to.
    pub goal: Goal,
    /// Whether it meets it.
    pub pass: bool,
}

/// The cases of the fairness goals: a lone sender, equal senders, and one sender with twice
/// the demand of the others. Two more lone-sender rows separate what the share costs from
/// what strict FIFO costs: shares off (100 %), and shares off with every request 8 chunks (a
/// divisor of the buffer, so a waiting head always fits once a request ends).
pub fn cases() -> Vec<Case> {
    let case = |name: String, senders, heavy, share_percent| Case {
        name,
        senders,
        heavy,
        share_percent,
        fixed_chunks: None,
    };
    let mut v = vec![
        case("1 sender".into(), 1, false, None),
        case("1 sender, share 100 %".into(), 1, false, Some(100)),
        Case {
            fixed_chunks: Some(8),
            ..case(
                "1 sender, share 100 %, 8-chunk requests".into(),
                1,
                false,
                Some(100),
            )
        },
    ];
    for n in [2, 4, 8] {
        v.push(case(format!("{n} equal"), n, false, None));
    }
    for n in [2, 4, 8] {
        v.push(case(format!("{n}, one 2× demand"), n, true, None));
    }
    v
}

/// The goal of `case`.
pub fn goal_of(case: &Case) -> Goal {
    if case.senders == 1 {
        Goal::Utilization(0.98)
    } else if case.heavy {
        Goal::HeavyWithinShare
    } else {
        Goal::Jain(0.95)
    }
}

/// Builds the harness cluster of `case`.
pub fn spec(setup: &Setup, case: &Case) -> ClusterSpec {
    let share = case
        .share_percent
        .unwrap_or(ReceiverConfig::default().peer_share_percent);
    let mut spec = ClusterSpec::new(case.senders, 1, setup.buffer_slots, setup.staging_slots)
        .with_peer_share(share);
    spec.interleave = setup.interleave;
    spec.timing.write_time = Duration::from_micros(setup.write_us);
    spec.timing.decode_delay = Duration::from_micros(setup.decode_delay_us);
    for s in 0..case.senders {
        let mut rng = SeededRng::new(s as u64);
        let scale = if case.heavy && s == 0 { 2 } else { 1 };
        for i in 0..setup.requests {
            let drawn = rng.range_u32(setup.chunks.0, setup.chunks.1);
            let chunks = case.fixed_chunks.unwrap_or(drawn) * scale;
            let plan = RequestPlan::new(s, 0, format!("s{s}-r{i}"), chunks, setup.batch_chunks);
            spec = spec.with(plan);
        }
    }
    spec
}

fn secs(t: kvx_proto::Instant) -> f64 {
    t.since_epoch().as_secs_f64()
}

/// Runs `case` and measures it.
pub fn run(setup: &Setup, case: &Case) -> Row {
    let spec = spec(setup, case);
    let share_slots = spec.receivers[0].peer_slots_max();
    let plans = spec.requests.clone();
    let report: Report = Cluster::new(spec)
        .run(u64::MAX, Duration::from_secs(3_600))
        .unwrap_or_else(|stuck| panic!("{}: {stuck}", case.name));
    let mut holds = Vec::new();
    let mut last_begun = vec![f64::INFINITY; case.senders];
    let mut first_reserved = f64::INFINITY;
    for (plan, got) in plans.iter().zip(&report.plans) {
        if let Some(b) = got.begun_at {
            let s = plan.sender;
            // The last request of a sender is its last planned one (each sender's requests
            // begin in plan order).
            last_begun[s] = secs(b);
        }
        if let (Some(at), Some(end), Some(q)) = (got.reserved_at, got.released_at, got.queued_for) {
            first_reserved = first_reserved.min(secs(at));
            holds.push(Hold {
                sender: plan.sender,
                slots: got.reserved_slots,
                queued_at: secs(at) - q.as_secs_f64(),
                reserved_at: secs(at),
                released_at: secs(end),
            });
        }
    }
    let end = last_begun.iter().copied().fold(f64::INFINITY, f64::min);
    let measures = measure(
        &holds,
        case.senders,
        setup.buffer_slots,
        first_reserved,
        end,
    );
    let total: f64 = measures.slot_seconds.iter().sum();
    let split = measures
        .slot_seconds
        .iter()
        .map(|x| if total > 0.0 { x / total } else { 0.0 })
        .collect();
    let weighted: Vec<f64> = measures
        .slot_seconds
        .iter()
        .enumerate()
        .map(|(s, x)| if case.heavy && s == 0 { x / 2.0 } else { *x })
        .collect();
    let goal = goal_of(case);
    let jain_raw = jain(&measures.slot_seconds);
    let pass = match goal {
        Goal::Utilization(min) => measures.utilization >= min,
        Goal::Jain(min) => jain_raw >= min,
        Goal::HeavyWithinShare => measures.peak_while_others_wait[0] <= share_slots,
    };
    let delivered = report
        .plans
        .iter()
        .filter(|p| p.sender_end == Some(End::Delivered) && p.consumed_at.is_some())
        .count();
    Row {
        case: case.clone(),
        share_slots,
        window_s: end - first_reserved,
        delivered,
        planned: plans.len(),
        jain: jain_raw,
        jain_weighted: jain(&weighted),
        split,
        measures,
        goal,
        pass,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn jain_is_one_when_equal_and_one_over_n_when_one_takes_all() {
        assert!(close(jain(&[3.0, 3.0, 3.0, 3.0]), 1.0));
        assert!(close(jain(&[5.0, 0.0, 0.0, 0.0]), 0.25));
        assert!(close(jain(&[7.0, 0.0]), 0.5));
        // Two to one: 9 / (2 · 5).
        assert!(close(jain(&[2.0, 1.0]), 0.9));
        assert!(close(jain(&[]), 1.0));
    }

    fn hold(sender: usize, slots: u32, q: f64, r: f64, e: f64) -> Hold {
        Hold {
            sender,
            slots,
            queued_at: q,
            reserved_at: r,
            released_at: e,
        }
    }

    #[test]
    fn utilization_and_slot_seconds_are_clipped_to_the_window() {
        // Capacity 4, window [0, 10): sender 0 holds 2 slots throughout, sender 1 holds 2
        // slots for [5, 15) — half of it inside the window.
        let holds = [hold(0, 2, -1.0, -1.0, 20.0), hold(1, 2, 0.0, 5.0, 15.0)];
        let m = measure(&holds, 2, 4, 0.0, 10.0);
        assert!(close(m.slot_seconds[0], 20.0), "{m:?}");
        assert!(close(m.slot_seconds[1], 10.0), "{m:?}");
        assert!(close(m.utilization, 30.0 / 40.0), "{m:?}");
        // Sender 1 waited [0, 5): half the window; sender 0 never did.
        assert!(close(m.backlogged[1], 0.5), "{m:?}");
        assert!(close(m.backlogged[0], 0.0), "{m:?}");
        // While sender 1 waited, sender 0 held 2; sender 0 never waited, so sender 1 never
        // held anything while another waited.
        assert_eq!(m.peak_while_others_wait, vec![2, 0]);
    }

    #[test]
    fn a_full_buffer_is_utilization_one_and_a_swap_at_one_instant_is_no_overlap() {
        // Capacity 4: sender 0 holds all 4 slots for [0, 5), gives them back and reserves
        // them again at 5 for [5, 10), while sender 1 waits all along. At 5 sender 0 holds
        // 4, not 8.
        // The second hold first: its reservation at 5 is swept before the first's release.
        let holds = [
            hold(0, 4, 1.0, 5.0, 10.0),
            hold(0, 4, 0.0, 0.0, 5.0),
            hold(1, 4, 0.0, 10.0, 12.0),
        ];
        let m = measure(&holds, 2, 4, 0.0, 10.0);
        assert!(close(m.utilization, 1.0), "{m:?}");
        assert!(close(m.backlogged[0], 0.4), "{m:?}");
        assert!(close(m.backlogged[1], 1.0), "{m:?}");
        assert_eq!(m.peak_while_others_wait, vec![4, 0]);
        assert!(close(jain(&m.slot_seconds), 0.5), "{m:?}");
    }
}
