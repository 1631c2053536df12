//! Arbitrary bytes into the wire decoder (`docs/spec/wire.md` §3): it must never panic, and
//! whatever it accepts must survive encode → decode unchanged.
//!
//! `cd fuzz && cargo +nightly fuzz run wire_decode`

#![no_main]

use kvx_proto::wire::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = decode(data) {
        let bytes = encode(&msg);
        let again = decode(&bytes).expect("invariant: kvx decodes what kvx encodes");
        assert_eq!(again, msg, "encode -> decode changed the message");
        // Our encoding is canonical: encoding the re-decoded value gives the same bytes.
        assert_eq!(encode(&again), bytes);
    }
});
