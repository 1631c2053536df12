//! Arbitrary event sequences into the sans-IO core (`kvx_proto::testing::OpWorld`): every
//! pair of bytes picks the next event (a begin, a batch, a delivery on one link, a write
//! completing or failing, a cancel, time passing, a consume, a lost connection).
//! `check_invariants()` runs after each, writes may land only in live grants, and once the
//! faults stop every request must end with every buffer free. Any panic is a finding.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvx_proto::testing::OpWorld::run(data);
});
