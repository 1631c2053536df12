//! The end-to-end chunk checksum (XXH3-64, folded to 32 bits) over a 1 MiB chunk, against a
//! plain copy of the same chunk in the same run (the cheapest thing the data path already does
//! to every byte), and against CRC32C (the CPU's CRC32 instruction), the alternative it was
//! chosen over: what checksums add per byte, on each side.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn checksum(c: &mut Criterion) {
    const CHUNK: usize = 1 << 20;
    let src: Vec<u8> = (0..CHUNK).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; CHUNK];
    let mut group = c.benchmark_group("checksum_1mib");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    group.bench_function("kvx_checksum", |b| {
        b.iter(|| black_box(kvx_io::chunk_checksum(black_box(&src))))
    });
    group.bench_function("kvx_checksum_in_64k_pieces", |b| {
        b.iter(|| {
            let mut s = kvx_io::ChecksumState::default();
            for piece in black_box(&src).chunks(64 << 10) {
                s.update(piece);
            }
            black_box(s.value())
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
    group.finish();
}

criterion_group!(benches, checksum);
criterion_main!(benches);
