//! Properties over random workloads and fault timings (proptest). The harness runs every
//! node's `check_invariants()` and the global checker after every step, so each case checks:
//! - the sum of reservations never exceeds capacity, and available + reserved + held +
//!   quarantined always equals capacity (`ReceiverLedger::check_invariants`);
//! - no slot has two owners, no write lands outside its grant (ledger + checker);
//! - after quiescence every buffer and staging pool is entirely free (final check);
//! - every request ends exactly once, as delivered or failed, at its sender, the proxy and
//!   its receiver (checker + final check);
//! - `ProxyNotif` only for fully written requests, at most once (checker).

use std::time::Duration;

use kvx_proto::config::Pipelining;
use kvx_proto::testing::{Cluster, ClusterSpec, End, RequestPlan};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// (sender, chunks, batch_chunks, start µs, cancel after µs, failing chunk)
type PlanTuple = (usize, u32, u32, u64, Option<u64>, Option<u32>);

#[derive(Debug, Clone)]
struct Case {
    senders: usize,
    buffer: u32,
    staging: u32,
    interleave: usize,
    serial: Vec<bool>,
    jitter_us: u64,
    seed: u64,
    requests: Vec<PlanTuple>,
    kill: Option<(usize, u64)>,
    /// Time one write takes, in µs; sometimes longer than the receiver's 1 s lease.
    write_us: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        4u32..=24,
        1u32..=12,
        1usize..=3,
        0u64..300,
        any::<u64>(),
    )
        .prop_flat_map(|(senders, buffer, staging, interleave, jitter_us, seed)| {
            let request = (
                0..senders,
                1..=buffer + 2,
                1u32..=4,
                0u64..3_000,
                prop::option::weighted(0.25, 0u64..3_000),
                prop::option::weighted(0.1, 0u32..8),
            );
            (
                prop::collection::vec(any::<bool>(), senders),
                prop::collection::vec(request, 1..=10),
                prop::option::weighted(0.15, (0..senders, 0u64..3_000)),
                prop_oneof![8 => 10u64..200, 1 => 300_000u64..1_500_000],
            )
                .prop_map(move |(serial, requests, kill, write_us)| Case {
                    senders,
                    buffer,
                    staging,
                    interleave,
                    serial,
                    jitter_us,
                    seed,
                    requests,
                    kill,
                    write_us,
                })
        })
}

fn spec_of(case: &Case) -> ClusterSpec {
    let mut spec = ClusterSpec::new(case.senders, 1, case.buffer, case.staging);
    spec.interleave = case.interleave;
    spec.seed = case.seed;
    spec.timing.jitter = Duration::from_micros(case.jitter_us);
    spec.timing.write_time = Duration::from_micros(case.write_us);
    spec.receivers[0].request_idle_timeout = Duration::from_secs(1);
    spec.receivers[0].write_quarantine = Duration::from_secs(5);
    for sender in &mut spec.senders {
        // Valid deployments keep a sender's write timeout below the receiver's lease
        // (`ReceiverConfig::check_sender`): slow writes then fail at the sender first.
        sender.write_timeout = Duration::from_millis(800);
        sender.reply_timeout = Duration::from_secs(1);
        spec.receivers[0]
            .check_sender(sender)
            .expect("a valid pairing");
    }
    for (s, serial) in case.serial.iter().enumerate() {
        if *serial {
            spec.senders[s].pipelining = Pipelining::Off;
        }
    }
    for (k, &(s, chunks, batch, start_us, cancel_us, fail)) in case.requests.iter().enumerate() {
        spec.requests.push(RequestPlan {
            start_after: Duration::from_micros(start_us),
            cancel_after: cancel_us.map(Duration::from_micros),
            fail_write_of_chunk: fail,
            ..RequestPlan::new(s, 0, format!("p{k}"), chunks, batch)
        });
    }
    if let Some((s, at_us)) = case.kill {
        spec.kill_sender_after
            .push((s, Duration::from_micros(at_us)));
    }
    spec
}

proptest! {
    #![proptest_config(ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/properties.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_workloads_keep_every_invariant(case in case()) {
        let spec = spec_of(&case);
        let buffer = case.buffer;
        let plans = spec.requests.clone();
        let killed = case.kill.map(|k| k.0);
        let report = match Cluster::new(spec).run(2_000_000, Duration::from_secs(7_200)) {
            Ok(r) => r,
            Err(stuck) => return Err(TestCaseError::fail(stuck.to_string())),
        };
        // Liveness: with no fault on a request and no dead sender, it is delivered.
        for (plan, rep) in plans.iter().zip(&report.plans) {
            let faulted = plan.cancel_after.is_some()
                || plan.fail_write_of_chunk.is_some_and(|c| c < plan.chunks)
                || killed.is_some()
                || case.write_us >= 300_000
                || plan.chunks > buffer;
            if !faulted {
                prop_assert_eq!(&rep.sender_end, &Some(End::Delivered), "{} {:?}", plan.req_id, rep);
            }
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let case = Case {
        senders: 3,
        buffer: 12,
        staging: 5,
        interleave: 2,
        serial: vec![false, true, false],
        jitter_us: 250,
        seed: 42,
        requests: (0..9)
            .map(|k| {
                (
                    k % 3,
                    1 + (k as u32 * 5) % 12,
                    2,
                    k as u64 * 100,
                    None,
                    None,
                )
            })
            .collect(),
        kill: None,
        write_us: 100,
    };
    let a = Cluster::new(spec_of(&case))
        .run(1_000_000, Duration::from_secs(7_200))
        .expect("settles");
    let b = Cluster::new(spec_of(&case))
        .run(1_000_000, Duration::from_secs(7_200))
        .expect("settles");
    assert_eq!(a.steps, b.steps);
    assert_eq!(a.plans, b.plans);
}

proptest! {
    #![proptest_config(ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/properties.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    /// Arbitrary event sequences straight into the core (deliveries in any order across
    /// links, write failures, cancels, lost connections, time jumps): every invariant holds
    /// after every event, and once faults stop every request ends and every buffer is free.
    #[test]
    fn arbitrary_event_sequences_end_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..800)) {
        kvx_proto::testing::OpWorld::run(&bytes);
    }
}
