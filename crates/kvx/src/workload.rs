//! The synthetic workload of `kvx demo` (and later `kvx sender`): per sender, a list of
//! requests with seeded random sizes and cancel points.

use std::time::Duration;

/// SplitMix64: a seeded, dependency-free stream; the workload must be the same for a seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn between(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One request of the demo workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub req_id: String,
    pub chunks: u32,
    /// Cancel it this long after it begins.
    pub cancel_after: Option<Duration>,
}

/// `requests` requests for sender `sender`, ids shaped like LMCache's captures
/// (`s0-r001-n5`).
pub fn plan(
    sender: u32,
    requests: u32,
    chunks: &std::ops::RangeInclusive<u32>,
    cancel_fraction: f64,
    rng: &mut Rng,
) -> Vec<Planned> {
    (0..requests)
        .map(|r| {
            let n = rng.between(*chunks.start(), *chunks.end());
            let cancel = rng.unit() < cancel_fraction;
            // Spread cancels over the first few milliseconds, where a request is mid-prefill.
            let cancel_after = cancel.then(|| Duration::from_micros(rng.between(0, 5_000).into()));
            Planned {
                req_id: format!("s{sender}-r{r:03}-n{n}"),
                chunks: n,
                cancel_after,
            }
        })
        .collect()
}
