//! Hostile and unusual input for the wire decoder (`docs/spec/wire.md` §3): it must return
//! a typed error, never panic, never allocate beyond the frame, and accept exactly what
//! msgspec accepts.

use std::fs;

use kvx_proto::wire::{
    decode, decode_with_limit, encode, AllocRequest, AllocResponse, CancelNotif, DecodeError,
    FailNotif, Message, ProxyNotif, DEFAULT_FRAME_MAX_BYTES,
};
use proptest::prelude::*;

const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/");

fn unhex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).expect("ascii"), 16).expect("hex"))
        .collect()
}

fn goldens() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = fs::read_dir(GOLDEN_DIR)
        .unwrap_or_else(|e| {
            panic!("cannot list {GOLDEN_DIR}: {e} (is shared/ beside the checkout?)")
        })
        .map(|entry| entry.expect("dir entry").path())
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            name.ends_with(".hex") && !name.starts_with("zmtp_")
        })
        .map(|p| {
            let text = fs::read_to_string(&p).expect("readable golden file");
            (p.display().to_string(), unhex(&text))
        })
        .collect();
    out.sort();
    assert!(
        out.len() >= 9,
        "expected the 9 golden message files in {GOLDEN_DIR}"
    );
    out
}

/// msgpack str of `s` in its shortest form (tests build messages by hand from these).
fn s(text: &str) -> Vec<u8> {
    assert!(text.len() < 32);
    let mut out = vec![0xa0 | text.len() as u8];
    out.extend_from_slice(text.as_bytes());
    out
}

/// A map of `entries` from already-encoded keys and values.
fn map(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    assert!(entries.len() < 16);
    let mut out = vec![0x80 | entries.len() as u8];
    for (k, v) in entries {
        out.extend_from_slice(k);
        out.extend_from_slice(v);
    }
    out
}

/// The §2.3 AllocRequest as entries, so tests can swap one value out.
fn alloc_request_entries() -> Vec<(Vec<u8>, Vec<u8>)> {
    vec![
        (s("type"), s("AllocRequest")),
        (s("keys"), [vec![0x92], s("k0"), s("k1")].concat()),
        (s("fmt"), vec![0x01]),
        (s("shape"), unhex("94 02 20 cd0100 cd0400")),
        (s("dtype"), s("bfloat16")),
        (s("last_chunk_toks"), vec![0x64]),
        (s("req_id"), s("17")),
        (s("is_last_batch"), vec![0xc2]),
        (s("total_chunks"), vec![0x05]),
    ]
}

fn with_value(field: &str, value: Vec<u8>) -> Vec<u8> {
    let mut entries = alloc_request_entries();
    let slot = entries
        .iter_mut()
        .find(|(k, _)| *k == s(field))
        .expect("known field");
    slot.1 = value;
    map(&entries)
}

fn decode_alloc_request(bytes: &[u8]) -> AllocRequest {
    match decode(bytes) {
        Ok(Message::AllocRequest(m)) => m,
        other => panic!("expected an AllocRequest, got {other:?}"),
    }
}

fn assert_wrong_type(bytes: &[u8], path: &str, expected: &str, found: &str) {
    match decode(bytes) {
        Err(DecodeError::WrongType {
            path: p,
            expected: e,
            found: f,
        }) => {
            assert_eq!((p.as_str(), e, f), (path, expected, found));
        }
        other => panic!("expected WrongType at {path}, got {other:?}"),
    }
}

#[test]
fn every_truncation_of_every_golden_is_an_error() {
    for (name, bytes) in goldens() {
        assert!(decode(&bytes).is_ok(), "{name}");
        for cut in 0..bytes.len() {
            let err = decode(&bytes[..cut]).expect_err("a strict prefix is never a message");
            assert!(
                matches!(err, DecodeError::Truncated { .. }),
                "{name} cut at {cut}: unexpected {err:?}"
            );
        }
    }
}

#[test]
fn every_single_byte_corruption_of_every_golden_is_handled() {
    for (_, bytes) in goldens() {
        for at in 0..bytes.len() {
            for flip in [0x01, 0x10, 0x80, 0xff] {
                let mut corrupt = bytes.clone();
                corrupt[at] ^= flip;
                if let Ok(msg) = decode(&corrupt) {
                    assert_eq!(decode(&encode(&msg)).expect("re-decodes"), msg);
                }
            }
        }
    }
}

#[test]
fn the_reference_entries_decode() {
    let m = decode_alloc_request(&map(&alloc_request_entries()));
    assert_eq!(
        (m.keys.len(), m.shape, m.total_chunks),
        (2, vec![2, 32, 256, 1024], 5)
    );
}

#[test]
fn wrong_typed_fields_name_the_field() {
    assert_wrong_type(&with_value("fmt", s("1")), "AllocRequest.fmt", "int", "str");
    assert_wrong_type(
        &with_value("fmt", unhex("cb3ff0000000000000")),
        "AllocRequest.fmt",
        "int",
        "float",
    );
    assert_wrong_type(
        &with_value("keys", s("k0")),
        "AllocRequest.keys",
        "array",
        "str",
    );
    assert_wrong_type(
        &with_value("keys", unhex("92 a26b30 05")),
        "AllocRequest.keys[1]",
        "str",
        "int",
    );
    assert_wrong_type(
        &with_value("shape", unhex("91 c3")),
        "AllocRequest.shape[0]",
        "int",
        "bool",
    );
    assert_wrong_type(
        &with_value("req_id", vec![0xc0]),
        "AllocRequest.req_id",
        "str",
        "nil",
    );
    assert_wrong_type(
        &with_value("dtype", unhex("80")),
        "AllocRequest.dtype",
        "str",
        "map",
    );
    let err = decode(&with_value("fmt", s("1"))).expect_err("wrong type");
    assert_eq!(
        err.to_string(),
        "`AllocRequest.fmt`: expected int, found str"
    );
}

#[test]
fn int_for_bool_is_rejected() {
    for int in [vec![0x00], vec![0x01], unhex("cc01")] {
        assert_wrong_type(
            &with_value("is_last_batch", int),
            "AllocRequest.is_last_batch",
            "bool",
            "int",
        );
    }
    // The same rule holds for kvx's Option<bool> extension.
    let bytes = encode(&Message::CancelNotif(CancelNotif {
        req_id: "r".into(),
        keys: vec![],
        seq: None,
        drained: Some(true),
    }));
    let mut int_drained = bytes.clone();
    *int_drained.last_mut().expect("non-empty") = 0x01;
    assert_wrong_type(&int_drained, "CancelNotif.drained", "bool", "int");
}

#[test]
fn bin_for_str_is_rejected() {
    // bin8 "17" as req_id, as a key element, as the tag, and as a map key.
    assert_wrong_type(
        &with_value("req_id", unhex("c4023137")),
        "AllocRequest.req_id",
        "str",
        "bin",
    );
    assert_wrong_type(
        &with_value("keys", unhex("91 c4026b30")),
        "AllocRequest.keys[0]",
        "str",
        "bin",
    );
    let tag_as_bin = map(&[(s("type"), [vec![0xc4, 10], b"ProxyNotif".to_vec()].concat())]);
    assert_wrong_type(&tag_as_bin, "message.type", "str", "bin");
    let mut entries = alloc_request_entries();
    entries[6].0 = [vec![0xc4, 6], b"req_id".to_vec()].concat();
    assert_wrong_type(&map(&entries), "AllocRequest.<map key>", "str", "bin");
}

#[test]
fn every_int_width_is_accepted() {
    let five = [
        "05",
        "cc05",
        "cd0005",
        "ce00000005",
        "cf0000000000000005",
        "d005",
        "d10005",
        "d200000005",
        "d30000000000000005",
    ];
    for form in five {
        assert_eq!(
            decode_alloc_request(&with_value("total_chunks", unhex(form))).total_chunks,
            5,
            "{form}"
        );
    }
    let big = decode_alloc_request(&with_value("last_chunk_toks", unhex("cfffffffffffffffff")));
    assert_eq!(big.last_chunk_toks, u64::MAX);
    let resp = map(&[
        (s("type"), s("AllocResponse")),
        (
            s("remote_indexes"),
            unhex("95 ff d0ff d1ffff d2ffffffff d3ffffffffffffffff"),
        ),
    ]);
    assert_eq!(
        decode(&resp).expect("decodes"),
        Message::AllocResponse(AllocResponse::granted(vec![-1; 5], None, None))
    );
}

#[test]
fn out_of_range_ints_are_rejected() {
    let cases = [
        ("total_chunks", "ff", "AllocRequest.total_chunks", -1i128),
        (
            "total_chunks",
            "cf0000000100000000",
            "AllocRequest.total_chunks",
            1 << 32,
        ),
        ("fmt", "d0ff", "AllocRequest.fmt", -1),
        (
            "last_chunk_toks",
            "d3ffffffffffffffff",
            "AllocRequest.last_chunk_toks",
            -1,
        ),
    ];
    for (field, value, path, expected_value) in cases {
        match decode(&with_value(field, unhex(value))) {
            Err(DecodeError::IntOutOfRange {
                path: p, value: v, ..
            }) => assert_eq!((p.as_str(), v), (path, expected_value)),
            other => panic!("{field}={value}: {other:?}"),
        }
    }
    let resp = map(&[
        (s("type"), s("AllocResponse")),
        (s("remote_indexes"), unhex("91 cfffffffffffffffff")),
    ]);
    assert!(matches!(
        decode(&resp),
        Err(DecodeError::IntOutOfRange { .. })
    ));
}

#[test]
fn str8_and_str16_keys_and_values_are_accepted() {
    let mut entries = alloc_request_entries();
    entries[0].0 = unhex("d904 74797065"); // "type" as str8
    entries[1].0 = unhex("da0004 6b657973"); // "keys" as str16
    entries[6].1 = unhex("db00000002 3137"); // "17" as str32
    let m = decode_alloc_request(&map(&entries));
    assert_eq!((m.keys.len(), m.req_id.as_str()), (2, "17"));
}

#[test]
fn type_may_come_anywhere_and_must_agree() {
    let mut entries = alloc_request_entries();
    entries.rotate_left(1); // "type" last
    assert_eq!(decode_alloc_request(&map(&entries)).req_id, "17");
    entries.rotate_left(4); // "type" in the middle
    assert_eq!(decode_alloc_request(&map(&entries)).req_id, "17");

    let mut twice = alloc_request_entries();
    twice.push((s("type"), s("AllocRequest")));
    assert_eq!(decode_alloc_request(&map(&twice)).req_id, "17");
    twice.last_mut().expect("pushed").1 = s("ProxyNotif");
    assert!(matches!(
        decode(&map(&twice)),
        Err(DecodeError::Malformed(_))
    ));
}

#[test]
fn unknown_or_missing_tag_is_typed() {
    let unknown = map(&[(s("type"), s("NixlInitRequest")), (s("req_id"), s("1"))]);
    assert_eq!(
        decode(&unknown),
        Err(DecodeError::UnknownType("NixlInitRequest".to_owned()))
    );
    let no_tag = map(&[(s("req_id"), s("1"))]);
    assert_eq!(decode(&no_tag), Err(DecodeError::MissingType));
    assert_wrong_type(
        &map(&[(s("type"), vec![0x01])]),
        "message.type",
        "str",
        "int",
    );
}

#[test]
fn missing_required_fields_are_named() {
    let mut entries = alloc_request_entries();
    entries.retain(|(k, _)| *k != s("dtype"));
    assert_eq!(
        decode(&map(&entries)),
        Err(DecodeError::MissingField {
            message: "AllocRequest",
            field: "dtype"
        })
    );
    let cancel = map(&[(s("type"), s("CancelNotif")), (s("req_id"), s("1"))]);
    assert_eq!(
        decode(&cancel),
        Err(DecodeError::MissingField {
            message: "CancelNotif",
            field: "keys"
        })
    );
    let fail = map(&[(s("type"), s("FailNotif")), (s("req_id"), s("1"))]);
    assert_eq!(
        decode(&fail),
        Err(DecodeError::MissingField {
            message: "FailNotif",
            field: "reason"
        })
    );
}

#[test]
fn non_maps_and_trailing_bytes_are_rejected() {
    assert_eq!(
        decode(&unhex("92 01 02")),
        Err(DecodeError::NotAMap { found: "array" })
    );
    assert_eq!(decode(&[]), Err(DecodeError::Truncated { offset: 0 }));
    let mut bytes = map(&alloc_request_entries());
    let len = bytes.len();
    bytes.push(0xc0);
    assert_eq!(
        decode(&bytes),
        Err(DecodeError::TrailingBytes {
            offset: len,
            len: 1
        })
    );
}

#[test]
fn invalid_utf8_and_reserved_markers_are_rejected() {
    assert_eq!(
        decode(&with_value("req_id", unhex("a2 ff fe"))),
        Err(DecodeError::InvalidUtf8 {
            path: "AllocRequest.req_id".to_owned()
        })
    );
    let mut entries = alloc_request_entries();
    entries.push((s("junk"), vec![0xc1]));
    assert!(matches!(
        decode(&map(&entries)),
        Err(DecodeError::Malformed(_))
    ));
}

#[test]
fn unknown_keys_must_still_be_valid_str() {
    let mut entries = alloc_request_entries();
    entries.push((unhex("a2 fffe"), vec![0x01]));
    let err = decode(&map(&entries)).expect_err("invalid UTF-8 key");
    assert_eq!(
        err,
        DecodeError::InvalidUtf8 {
            path: "AllocRequest.<map key>".to_owned()
        }
    );
    let mut entries = alloc_request_entries();
    entries.push((vec![0x07], vec![0x01]));
    assert_wrong_type(&map(&entries), "AllocRequest.<map key>", "str", "int");
}

/// msgspec assigns a repeated field each time it sees it, so the last value wins.
#[test]
fn a_repeated_field_takes_its_last_value() {
    let mut entries = alloc_request_entries();
    entries.push((s("req_id"), s("18")));
    assert_eq!(decode_alloc_request(&map(&entries)).req_id, "18");
}

#[test]
fn oversized_frames_are_refused_before_parsing() {
    let big = vec![0u8; DEFAULT_FRAME_MAX_BYTES + 1];
    assert_eq!(
        decode(&big),
        Err(DecodeError::FrameTooLarge {
            len: DEFAULT_FRAME_MAX_BYTES + 1,
            max: DEFAULT_FRAME_MAX_BYTES
        })
    );
    let bytes = map(&alloc_request_entries());
    assert_eq!(
        decode_with_limit(&bytes, 100),
        Err(DecodeError::FrameTooLarge {
            len: bytes.len(),
            max: 100
        })
    );
    assert!(decode_with_limit(&bytes, bytes.len()).is_ok());
}

/// Length prefixes claiming 2^32 elements must fail at once, without allocating for them.
#[test]
fn hostile_lengths_fail_without_allocating() {
    for header in ["dd ffffffff", "dc ffff"] {
        assert!(matches!(
            decode(&with_value("keys", unhex(header))),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            decode(&with_value("shape", unhex(header))),
            Err(DecodeError::Truncated { .. })
        ));
    }
    assert!(matches!(
        decode(&with_value("req_id", unhex("db ffffffff 31"))),
        Err(DecodeError::Truncated { .. })
    ));
    assert!(matches!(
        decode(&unhex("df ffffffff a474797065")),
        Err(DecodeError::Truncated { .. })
    ));
    // An unknown field claiming a huge map or array, or a huge ext/bin payload.
    for junk in [
        "df ffffffff",
        "dd ffffffff",
        "c6 ffffffff",
        "c9 ffffffff 01",
    ] {
        let mut entries = alloc_request_entries();
        entries.push((s("junk"), unhex(junk)));
        assert!(
            matches!(decode(&map(&entries)), Err(DecodeError::Truncated { .. })),
            "{junk}"
        );
    }
}

/// An unknown field nested a million levels deep is skipped without recursion.
#[test]
fn deep_nesting_in_unknown_fields_does_not_overflow_the_stack() {
    let mut entries = alloc_request_entries();
    let depth = DEFAULT_FRAME_MAX_BYTES - 256;
    let mut nested = vec![0x91; depth];
    nested.push(0x90);
    entries.push((s("junk"), nested));
    let bytes = map(&entries);
    assert!(bytes.len() <= DEFAULT_FRAME_MAX_BYTES);
    assert_eq!(decode_alloc_request(&bytes).req_id, "17");
    // Unterminated: every level open, input ends.
    let mut cut = bytes.clone();
    cut.truncate(bytes.len() - 1);
    assert!(matches!(decode(&cut), Err(DecodeError::Truncated { .. })));
}

#[test]
fn nil_reads_as_an_unset_extension() {
    let mut entries = alloc_request_entries();
    entries.push((s("seq"), vec![0xc0]));
    assert_eq!(decode_alloc_request(&map(&entries)).seq, None);
}

// ---------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9@_-]{0,40}",
        1 => any::<String>(),
        1 => "x{250,300}", // str8 / str16 boundaries
    ]
}

fn texts() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(text(), 0..20)
}

fn message() -> impl Strategy<Value = Message> {
    let alloc_request = (
        texts(),
        any::<u32>(),
        prop::collection::vec(any::<u64>(), 0..6),
        text(),
        any::<u64>(),
        text(),
        any::<bool>(),
        any::<u32>(),
        any::<Option<u64>>(),
    )
        .prop_map(
            |(
                keys,
                fmt,
                shape,
                dtype,
                last_chunk_toks,
                req_id,
                is_last_batch,
                total_chunks,
                seq,
            )| {
                Message::AllocRequest(AllocRequest {
                    keys,
                    fmt,
                    shape,
                    dtype,
                    last_chunk_toks,
                    req_id,
                    is_last_batch,
                    total_chunks,
                    seq,
                    chunk_bytes: None,
                    claim: None,
                })
            },
        );
    let alloc_response = (
        prop::collection::vec(any::<i64>(), 0..40),
        prop::collection::vec(any::<i64>(), 0..4),
        any::<Option<u64>>(),
        prop::option::of(text()),
        prop::option::of(prop::collection::vec(any::<u32>(), 0..20)),
        prop::option::of(text()),
        any::<(Option<u64>, Option<u64>)>(),
    )
        .prop_map(
            |(remote_indexes, already_sent_indexes, seq, error, generations, credential, t)| {
                Message::AllocResponse(AllocResponse {
                    remote_indexes,
                    already_sent_indexes,
                    seq,
                    error,
                    generations,
                    fabric_credential: credential,
                    request_idle_timeout_ms: t.0,
                    write_quarantine_ms: t.1,
                })
            },
        );
    prop_oneof![
        alloc_request,
        alloc_response,
        text().prop_map(|req_id| Message::ProxyNotif(ProxyNotif { req_id })),
        (text(), texts(), any::<Option<u64>>(), any::<Option<bool>>()).prop_map(
            |(req_id, keys, seq, drained)| {
                Message::CancelNotif(CancelNotif {
                    req_id,
                    keys,
                    seq,
                    drained,
                })
            }
        ),
        (text(), text())
            .prop_map(|(req_id, reason)| Message::FailNotif(FailNotif { req_id, reason })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn messages_round_trip(msg in message()) {
        let bytes = encode(&msg);
        prop_assert_eq!(decode(&bytes), Ok(msg.clone()));
        // serde's derived Serialize agrees byte for byte (msgspec's layout).
        prop_assert_eq!(rmp_serde::to_vec_named(&msg).expect("serde encodes"), bytes);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    /// Random bytes rarely get past the map header; splice them into a real message.
    #[test]
    fn spliced_messages_never_panic(
        msg in message(),
        at in any::<prop::sample::Index>(),
        junk in prop::collection::vec(any::<u8>(), 0..16),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode(&msg);
        let at = at.index(bytes.len() + 1);
        bytes.splice(at..at, junk);
        bytes.truncate(cut.index(bytes.len() + 1).max(at));
        if let Ok(decoded) = decode(&bytes) {
            prop_assert_eq!(decode(&encode(&decoded)), Ok(decoded));
        }
    }
}
