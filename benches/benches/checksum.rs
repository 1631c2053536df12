//! The end-to-end chunk checksum (XXH3-64, folded to 32 bits) over 1 MiB chunks, against a
//! plain copy of the same chunks in the same run (the cheapest thing the data path already
//! does to every byte), and against CRC32C (the CPU's CRC32 instruction), the alternative it
//! was chosen over: what checksums add per byte, on each side.
//!
//! Two groups: one chunk, cache-hot (`checksum_1mib`), and 16 chunks in turn from one set of
//! buffers into another (`copy_16_chunks`: 32 MiB, as `kvx bench` cycles through its slots),
//! where a copy waits on memory and a checksum taken during the copy rides along with it.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const CHUNK: usize = 1 << 20;

fn chunk(seed: usize) -> Vec<u8> {
    (0..CHUNK).map(|i| ((i + seed) * 31 % 251) as u8).collect()
}

fn cache_hot(c: &mut Criterion) {
    let src = chunk(0);
    let mut dst = vec![0u8; CHUNK];
    let mut group = c.benchmark_group("checksum_1mib");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    group.bench_function("kvx_checksum", |b| {
        b.iter(|| black_box(kvx_io::chunk_checksum(black_box(&src))))
    });
    group.bench_function("kvx_checksum_landing_in_64k_pieces", |b| {
        b.iter(|| {
            let src = black_box(&src);
            let mut s = kvx_io::LandingChecksum::new(CHUNK);
            for end in (64 << 10..=CHUNK).step_by(64 << 10) {
                s.advance(&src[..end]);
            }
            black_box(s.value(src))
        })
    });
    group.bench_function("crc32c", |b| {
        b.iter(|| black_box(crc32c::crc32c(black_box(&src))))
    });
    group.bench_function("baseline_memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    group.bench_function("copy_with_checksum", |b| {
        b.iter(|| black_box(kvx_io::copy_with_checksum(&mut dst, black_box(&src))))
    });
    group.finish();
}

fn cycling(c: &mut Criterion) {
    const CHUNKS: usize = 16;
    let src: Vec<Vec<u8>> = (0..CHUNKS).map(chunk).collect();
    let mut dst: Vec<Vec<u8>> = (0..CHUNKS).map(|_| vec![0u8; CHUNK]).collect();
    let mut group = c.benchmark_group("copy_16_chunks");
    group.throughput(Throughput::Bytes((CHUNK * CHUNKS) as u64));
    group.bench_function("baseline_memcpy", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&src) {
                d.copy_from_slice(s);
                black_box(&d);
            }
        })
    });
    group.bench_function("memcpy_then_checksum", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&src) {
                d.copy_from_slice(s);
                black_box(kvx_io::chunk_checksum(d));
            }
        })
    });
    group.bench_function("copy_with_checksum", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&src) {
                black_box(kvx_io::copy_with_checksum(d, s));
            }
        })
    });
    group.finish();
}

criterion_group!(benches, cache_hot, cycling);
criterion_main!(benches);
