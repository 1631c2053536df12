//! Wire codec cost for a full-size batch: a 16-key `AllocRequest` shaped like the LMCache
//! golden captures (`docs/spec/wire.md` §5). Target: encode + decode ≤ 2 µs.
//!
//! `cargo bench -p kvx-benches --bench codec -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvx_proto::wire::{decode, encode, encode_into, AllocRequest, AllocResponse, Message};

fn alloc_request_16() -> Message {
    Message::AllocRequest(AllocRequest {
        keys: (0..16)
            .map(|i| format!("pdsim@1@0@{}@bfloat16", 100_000 + i))
            .collect(),
        fmt: 1,
        shape: vec![2, 32, 256, 128],
        dtype: "bfloat16".to_owned(),
        last_chunk_toks: 256,
        req_id: "s0-r001-n16-t256".to_owned(),
        is_last_batch: false,
        total_chunks: 64,
        seq: Some(12_345),
        // A kvx sender declares each chunk's length (2 × 32 × 256 × 128 bf16 values).
        chunk_bytes: Some(vec![4 << 20; 16]),
        claim: None,
    })
}

fn codec(c: &mut Criterion) {
    let msg = alloc_request_16();
    let bytes = encode(&msg);
    let mut group = c.benchmark_group("codec/alloc_request_16_keys");
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("encode", |b| b.iter(|| encode(black_box(&msg))));
    let mut buf = Vec::with_capacity(bytes.len());
    group.bench_function("encode_into_reused", |b| {
        b.iter(|| {
            buf.clear();
            encode_into(black_box(&msg), &mut buf);
            black_box(buf.len())
        })
    });
    group.bench_function("decode", |b| {
        b.iter(|| decode(black_box(&bytes)).expect("invariant: bench bytes decode"))
    });
    group.bench_function("encode_decode", |b| {
        b.iter(|| decode(&encode(black_box(&msg))).expect("invariant: bench bytes decode"))
    });
    // Baselines in the same run: serde's derived codec (rmp-serde, the obvious alternative,
    // and laxer: it takes bin for str), and a bare copy of the same bytes.
    group.bench_function("baseline_serde_derive_encode_decode", |b| {
        b.iter(|| {
            let bytes = rmp_serde::to_vec_named(black_box(&msg)).expect("invariant: encodes");
            rmp_serde::from_slice::<Message>(&bytes).expect("invariant: decodes")
        })
    });
    group.bench_function("baseline_copy_bytes", |b| {
        b.iter(|| black_box(&bytes).clone())
    });
    group.finish();

    let reply = Message::AllocResponse(AllocResponse::granted(
        (0..16).collect(),
        Some(vec![1; 16]),
        Some(12_345),
    ));
    c.bench_function("codec/alloc_response_16_slots/encode_decode", |b| {
        b.iter(|| decode(&encode(black_box(&reply))).expect("invariant: bench bytes decode"))
    });
}

criterion_group!(benches, codec);
criterion_main!(benches);
