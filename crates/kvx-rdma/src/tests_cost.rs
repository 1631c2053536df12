//! What checksums cost over `RdmaFabric`, measured on the NIC model (`kvx bench --fabric
//! rdma` needs a device): the same writes, with and without their checksums, alternating in
//! one run, timed from the first post until the receiver announced the last one (the
//! receiver's check runs before a write is announced, so it is inside the time). Ignored: run
//! it in a release build, `docs/PERFORMANCE.md` §Integrity says how and what it found.
//!
//! The model copies each write with the CPU (into a buffer, then into the slot), where a NIC's
//! DMA costs the CPU nothing: the ratio it gives is of this machine's CPU work, not of a
//! link's rate.

use std::time::{Duration, Instant};

use kvx_io::SlotGeometry;
use kvx_io::{Fabric, PostWrite, SlotMemory};
use kvx_proto::{PeerId, SlotIndex, StagingSlot, WriteId, WriteTag};

use crate::fake::FakeVerbs;
use crate::{RdmaConfig, RdmaFabric};

const CHUNK: usize = 1 << 20;
const WINDOW: u32 = 16;
const WRITES: u64 = 1024;
const ROUNDS: usize = 21;

/// Seconds to move `WRITES` chunks, `WINDOW` in flight, until the receiver announced them
/// all; each write carries its chunk's checksum when `sums`.
async fn timed_round(sums: bool) -> f64 {
    let f = RdmaFabric::with_verbs(FakeVerbs::new(), RdmaConfig::default()).expect("fabric");
    let mut listener = f
        .expose(
            "127.0.0.1:0",
            SlotGeometry::new(WINDOW, CHUNK).expect("a geometry"),
        )
        .await
        .expect("expose");
    for slot in 0..WINDOW {
        listener.access.grant_standing(slot, PeerId(1));
    }
    let credential = listener.access.credential_for(PeerId(1));
    let staging = f
        .allocate_staging(SlotGeometry::new(WINDOW, CHUNK).expect("a geometry"))
        .expect("staging");
    let mut checksums = Vec::new();
    for s in 0..WINDOW {
        let bytes: Vec<u8> = (0..CHUNK).map(|i| (i as u32 * 7 + s) as u8).collect();
        staging.write_slot(s, &bytes);
        // Taken once per staging slot, as `kvx bench` does: the receiver's check is measured.
        checksums.push(kvx_io::chunk_checksum(&bytes));
    }
    let mut conn = f
        .connect(&listener.local_endpoint, staging, credential)
        .await
        .expect("connect");
    let started = Instant::now();
    let (mut posted, mut done, mut announced) = (0u64, 0u64, 0u64);
    while announced < WRITES {
        while posted < WRITES && posted - done < u64::from(WINDOW) {
            let slot = (posted % u64::from(WINDOW)) as u32;
            conn.post(PostWrite {
                id: WriteId(posted),
                local: StagingSlot(slot),
                remote: SlotIndex(slot),
                len: CHUNK,
                imm: Some(
                    WriteTag {
                        slot: SlotIndex(slot),
                        generation: 0,
                    }
                    .to_imm(),
                ),
                checksum: sums.then(|| checksums[slot as usize]),
            })
            .expect("post");
            posted += 1;
        }
        tokio::select! {
            c = conn.next_completion() => {
                assert!(c.expect("open").result.is_ok());
                done += 1;
            }
            l = listener.landed.recv() => {
                let l = l.expect("open");
                let expected = if sums {
                    kvx_io::ChecksumCheck::Match
                } else {
                    kvx_io::ChecksumCheck::Absent
                };
                assert_eq!(l.checksum, expected);
                announced += 1;
            }
            () = tokio::time::sleep(Duration::from_secs(30)) => panic!("stalled"),
        }
    }
    started.elapsed().as_secs_f64()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// `cargo test -p kvx-rdma --release --lib -- --ignored --nocapture checksum_cost`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it in a release build"]
async fn checksum_cost_on_the_nic_model() {
    let bytes = (WRITES * CHUNK as u64) as f64;
    let (mut on, mut off, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // Alternate which goes first, so that a warming machine favours neither.
        let (a, b) = if round % 2 == 0 {
            let a = timed_round(false).await;
            (a, timed_round(true).await)
        } else {
            let b = timed_round(true).await;
            (timed_round(false).await, b)
        };
        println!(
            "round {round}: off {:.2} GB/s, on {:.2} GB/s, on/off {:.3}",
            bytes / a / 1e9,
            bytes / b / 1e9,
            a / b
        );
        off.push(bytes / a / 1e9);
        on.push(bytes / b / 1e9);
        ratios.push(a / b);
    }
    let sum_rate = {
        let data = vec![0x5Au8; CHUNK];
        let started = Instant::now();
        for _ in 0..256 {
            std::hint::black_box(kvx_io::chunk_checksum(std::hint::black_box(&data)));
        }
        256.0 * CHUNK as f64 / started.elapsed().as_secs_f64() / 1e9
    };
    println!(
        "{ROUNDS} rounds of {WRITES} x {CHUNK} B, {WINDOW} in flight: median off {:.2} GB/s, on {:.2} GB/s, median on/off {:.3}; chunk_checksum alone {sum_rate:.1} GB/s",
        median(off),
        median(on),
        median(ratios)
    );
}
