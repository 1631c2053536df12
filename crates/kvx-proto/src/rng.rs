//! `SeededRng`: the one deterministic generator of everything kvx draws from a seed — the
//! `testing` harness's link jitter, the simulation's world and swarm plans (`sim/`), and the
//! synthetic workload of `kvx demo` and `kvx sender`. The core never draws random numbers.
//!
//! xorshift64* (Vigna, "An experimental exploration of Marsaglia's xorshift generators"),
//! seeded through splitmix64. Written here rather than taken from a crate such as `rand_pcg`
//! because the seeds kept as regression tests were found on this very stream: the swarm's
//! scenarios and sweeps (`sim/tests/sim/swarm.rs`, `sim/sweeps.sh`, the broken variants' catch
//! table in `docs/sim.md`) and the harness's property-found scenarios
//! (`crates/kvx-proto/tests/scenarios.rs`, with fixed seeds). Another generator would change
//! what each of them exercises, and a kept seed that no longer reaches its bug passes
//! silently; re-finding them needs the bugs they guard back in. So the stream is part of the
//! contract: changing a constant below changes every kept seed.

use std::time::Duration;

/// A seeded xorshift64* stream; clones continue identically.
#[derive(Debug, Clone)]
pub struct SeededRng(u64);

impl SeededRng {
    /// The stream for `seed`; splitmix64 spreads small seeds (0, 1, 2 …) over the state space.
    pub fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self::from_state(z ^ (z >> 31))
    }

    /// The stream from a raw state (made odd: xorshift never leaves zero). For the harness,
    /// whose kept seeds were found with `seed × 0x9E37_79B9_7F4A_7C15` as the state.
    pub fn from_state(state: u64) -> Self {
        SeededRng(state | 1)
    }

    /// A generator for one purpose, independent of how many numbers others draw later.
    pub fn fork(&mut self, purpose: u64) -> SeededRng {
        SeededRng::new(self.next_u64() ^ purpose.wrapping_mul(0xA24B_AED4_963E_E407))
    }

    /// The next number of the stream (xorshift64*).
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi` (modulo bias below 2⁻⁴⁰ for the spans kvx draws); `lo` when
    /// `hi <= lo`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// `range` for `u32` bounds.
    pub fn range_u32(&mut self, lo: u32, hi: u32) -> u32 {
        self.range(u64::from(lo), u64::from(hi)) as u32
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() <= p
    }

    /// Uniform in `lo..=hi`, at microsecond resolution.
    pub fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        Duration::from_micros(self.range(lo.as_micros() as u64, hi.as_micros() as u64))
    }

    /// One of `items` (not empty), uniformly.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.next_u64() as usize % items.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::SeededRng;

    /// The stream is part of the contract (module doc): the first numbers of seed 0, and of
    /// the state the harness makes of one of its kept seeds, as the generators this one
    /// replaced gave them.
    #[test]
    fn the_stream_is_the_one_kept_seeds_were_found_on() {
        let mut r = SeededRng::new(0);
        let first: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(
            first,
            [
                0x7bbc_b40d_5506_82d0,
                0xde7f_e413_d00c_c9fd,
                0xb3c6_3835_3c66_8c91
            ]
        );
        let state = 12_257_266_579_060_608_737u64.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        assert_eq!(
            SeededRng::from_state(state).next_u64(),
            0x7f0d_b3e9_333c_1624
        );
    }
}
