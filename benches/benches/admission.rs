//! Admission decision + release (issue floor: ≥ 5 million per second), and for context the
//! same through the whole receiver ledger (probe in, reply out, cancel in, ack out).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvx_proto::admission::{Admission, Decision, Limits};
use kvx_proto::receiver::ReceiverLedger;
use kvx_proto::wire::{AllocRequest, CancelNotif, Message};
use kvx_proto::{Instant, PeerId, ReceiverConfig, Ticket};

fn admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission");
    group.throughput(Throughput::Elements(1));
    let deadline = Instant::ZERO + Duration::from_secs(30);

    // A buffer half full of other reservations: the decision is made against a non-trivial
    // state, with per-peer shares on (the default's 75 %).
    let limits = |capacity: u32| Limits {
        peer_cap: capacity * 3 / 4,
        peer_queue_max: 256,
        ..Limits::fifo(capacity, 4096)
    };
    let (me, other) = (PeerId(1), PeerId(2));
    let mut adm = Admission::new(limits(1024));
    assert_eq!(
        adm.request(Ticket(0), other, 512, deadline),
        Decision::Admitted
    );
    let mut t = 1u64;
    group.bench_function("decide_and_release", |b| {
        b.iter(|| {
            t += 1;
            let d = adm.request(Ticket(t), me, black_box(16), deadline);
            debug_assert_eq!(d, Decision::Admitted);
            adm.release(me, 16);
            black_box(d)
        })
    });

    // With a waiter queued, every release re-examines the queue head.
    let mut adm = Admission::new(Limits::fifo(64, 4096));
    assert_eq!(
        adm.request(Ticket(0), other, 60, deadline),
        Decision::Admitted
    );
    assert_eq!(
        adm.request(Ticket(1), other, 64, deadline),
        Decision::Queued
    );
    group.bench_function("decide_and_release_with_waiter", |b| {
        b.iter(|| {
            t += 1;
            let d = adm.request(Ticket(t), me, black_box(2), deadline);
            if d == Decision::Queued {
                adm.withdraw(Ticket(t));
            }
            black_box(d)
        })
    });

    // Baseline in the same run: the cheapest per-request bookkeeping a table-based design
    // would pay (insert and remove one entry in an ordered map).
    let mut table = std::collections::BTreeMap::new();
    for k in 0..64u64 {
        table.insert(k * 1_000_003, 16u32);
    }
    group.bench_function("baseline_btreemap_insert_remove", |b| {
        b.iter(|| {
            t += 1;
            table.insert(black_box(t), 16u32);
            black_box(table.remove(&t))
        })
    });

    let cfg = ReceiverConfig {
        buffer_slots: 1024,
        ..ReceiverConfig::default()
    };
    let mut ledger = ReceiverLedger::new(cfg).expect("valid config");
    let mut n = 0u64;
    group.bench_function("ledger_probe_and_cancel", |b| {
        b.iter(|| {
            n += 1;
            let req_id = format!("r{n}");
            let probe = AllocRequest {
                keys: Vec::new(),
                fmt: 1,
                shape: vec![2, 32, 256, 128],
                dtype: "bfloat16".into(),
                last_chunk_toks: 0,
                req_id: req_id.clone(),
                is_last_batch: false,
                total_chunks: 16,
                seq: Some(n),
                // A probe carries no keys, so no lengths.
                chunk_bytes: None,
                claim: None,
            };
            let now = Instant::ZERO;
            ledger.handle_message(now, PeerId(1), Message::AllocRequest(probe));
            let reply = ledger.poll_transmit();
            let cancel = CancelNotif {
                req_id,
                keys: Vec::new(),
                seq: Some(n),
                drained: Some(true),
            };
            ledger.handle_message(now, PeerId(1), Message::CancelNotif(cancel));
            black_box((reply, ledger.poll_transmit()));
            while ledger.poll_event().is_some() {}
        })
    });
    group.finish();
}

criterion_group!(benches, admission);
criterion_main!(benches);
