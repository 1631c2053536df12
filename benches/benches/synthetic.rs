//! The demo's test data: generating a 1 MiB chunk (the prefill's side) and checking one (the
//! decoder's), against a copy and a fill of the same 1 MiB in the same run. Both run once per
//! byte the demo moves, so they should cost about what touching the memory costs.
//!
//! `cargo bench -p kvx-benches --bench synthetic -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvx_node::synthetic::{chunk_bytes, chunk_matches};

const MIB: usize = 1 << 20;

fn synthetic(c: &mut Criterion) {
    let mut group = c.benchmark_group("synthetic/1MiB");
    group.throughput(Throughput::Bytes(MIB as u64));
    let mut out = vec![0u8; MIB];
    let src = vec![0x5Au8; MIB];
    let mut chunk = 0u32;
    group.bench_function("generate", |b| {
        b.iter(|| {
            chunk = chunk.wrapping_add(1);
            chunk_bytes("s0-r001", black_box(chunk), &mut out);
        })
    });
    let mut good = vec![0u8; MIB];
    chunk_bytes("s0-r001", 7, &mut good);
    group.bench_function("verify", |b| {
        b.iter(|| assert!(chunk_matches("s0-r001", 7, black_box(&good))))
    });
    group.bench_function("baseline_memcpy", |b| {
        b.iter(|| out.copy_from_slice(black_box(&src)))
    });
    group.bench_function("baseline_fill", |b| b.iter(|| out.fill(black_box(0x11))));
    group.finish();
}

criterion_group!(benches, synthetic);
criterion_main!(benches);
