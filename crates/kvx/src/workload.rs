//! The synthetic workload of `kvx demo` (and later `kvx sender`): per sender, a list of
//! requests with seeded random sizes and cancel points.

use std::time::Duration;

/// The workload's seeded generator (`kvx_proto::rng`, shared with the harness and the
/// simulation): a seed gives the same workload in every build and on every machine.
pub use kvx_proto::rng::SeededRng as Rng;

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
            let n = rng.range_u32(*chunks.start(), *chunks.end());
            let cancel = rng.unit() < cancel_fraction;
            // Spread cancels over the first few milliseconds, where a request is mid-prefill.
            let cancel_after = cancel.then(|| Duration::from_micros(rng.range(0, 5_000)));
            Planned {
                req_id: format!("s{sender}-r{r:03}-n{n}"),
                chunks: n,
                cancel_after,
            }
        })
        .collect()
}
