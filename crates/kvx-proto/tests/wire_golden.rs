//! Golden vectors: bytes captured from LMCache 0.5.6 (`shared/golden/`, see its README) and
//! the worked examples of reference §2.3 must decode to exactly the documented value, and
//! kvx must re-encode that value to exactly the same bytes (`docs/spec/wire.md` §2).

use std::collections::BTreeSet;
use std::fs;

use kvx_proto::wire::{
    decode, encode, encode_into, AllocRequest, AllocResponse, CancelNotif, FailNotif, Message,
    ProxyNotif,
};

/// CI checks kvx out beside `shared/`, so the vectors live at `../shared/golden/` from the
/// workspace root.
const GOLDEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/");

fn unhex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    assert!(digits.len().is_multiple_of(2), "odd number of hex digits");
    digits
        .chunks(2)
        .map(|pair| {
            let s = std::str::from_utf8(pair).expect("hex is ASCII");
            u8::from_str_radix(s, 16).expect("valid hex digit")
        })
        .collect()
}

fn golden(name: &str) -> Vec<u8> {
    let path = format!("{GOLDEN_DIR}{name}");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("cannot read golden vector {path}: {e} (is shared/ beside the checkout?)")
    });
    unhex(&text)
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

#[allow(clippy::too_many_arguments)]
fn alloc_request(
    keys: &[&str],
    shape: [u64; 4],
    last_chunk_toks: u64,
    req_id: &str,
    is_last_batch: bool,
    total_chunks: u32,
) -> Message {
    Message::AllocRequest(AllocRequest {
        keys: strings(keys),
        fmt: 1,
        shape: shape.to_vec(),
        dtype: "bfloat16".to_owned(),
        last_chunk_toks,
        req_id: req_id.to_owned(),
        is_last_batch,
        total_chunks,
        seq: None,
        chunk_bytes: None,
        claim: None,
    })
}

fn alloc_response(remote_indexes: &[i64]) -> Message {
    Message::AllocResponse(AllocResponse::granted(remote_indexes.to_vec(), None, None))
}

/// Every golden message file with the value its README section gives.
fn expectations() -> Vec<(&'static str, usize, Message)> {
    vec![
        (
            "alloc_request_first_batch.hex",
            181,
            alloc_request(
                &["pdsim@1@0@100000@bfloat16", "pdsim@1@0@100001@bfloat16"],
                [2, 2, 256, 64],
                256,
                "s0-r001-n5-t100",
                false,
                5,
            ),
        ),
        (
            "alloc_request_last_batch.hex",
            151,
            alloc_request(
                &["pdsim@1@0@100004@bfloat16"],
                [2, 2, 100, 64],
                100,
                "s0-r001-n5-t100",
                true,
                5,
            ),
        ),
        (
            "alloc_request_later_batch.hex",
            181,
            alloc_request(
                &["pdsim@1@0@100002@bfloat16", "pdsim@1@0@100003@bfloat16"],
                [2, 2, 256, 64],
                256,
                "s0-r001-n5-t100",
                false,
                5,
            ),
        ),
        (
            "alloc_request_oversized.hex",
            182,
            alloc_request(
                &["pdsim@1@0@300000@bfloat16", "pdsim@1@0@300001@bfloat16"],
                [2, 2, 256, 64],
                256,
                "s0-r003-n12-t256",
                false,
                12,
            ),
        ),
        ("alloc_response_cancel_ack.hex", 58, alloc_response(&[])),
        ("alloc_response_minus1.hex", 60, alloc_response(&[-1, -1])),
        ("alloc_response_ok.hex", 60, alloc_response(&[0, 1])),
        (
            "cancel_notif.hex",
            99,
            Message::CancelNotif(CancelNotif {
                req_id: "s0-r002-n4-t256".to_owned(),
                keys: strings(&["pdsim@1@0@200000@bfloat16", "pdsim@1@0@200001@bfloat16"]),
                seq: None,
                drained: None,
            }),
        ),
        (
            "proxy_notif.hex",
            40,
            Message::ProxyNotif(ProxyNotif {
                req_id: "s0-r001-n5-t100".to_owned(),
            }),
        ),
    ]
}

fn assert_exact(name: &str, bytes: &[u8], expected: &Message) {
    let decoded = decode(bytes).unwrap_or_else(|e| panic!("{name}: decode failed: {e}"));
    assert_eq!(&decoded, expected, "{name}: decoded value differs");
    assert_eq!(
        encode(expected),
        bytes,
        "{name}: kvx's encoding differs from LMCache's bytes"
    );
}

#[test]
fn golden_files_decode_and_reencode_byte_for_byte() {
    for (name, len, expected) in expectations() {
        let bytes = golden(name);
        assert_eq!(bytes.len(), len, "{name}: length differs from the README");
        assert_exact(name, &bytes, &expected);
    }
}

/// A vector added to `shared/golden/` without an expectation here would go untested.
#[test]
fn every_golden_message_file_has_an_expectation() {
    let on_disk: BTreeSet<String> = fs::read_dir(GOLDEN_DIR)
        .unwrap_or_else(|e| panic!("cannot list {GOLDEN_DIR}: {e}"))
        .map(|entry| {
            entry
                .expect("readable dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".hex") && !name.starts_with("zmtp_"))
        .collect();
    let covered: BTreeSet<String> = expectations()
        .into_iter()
        .map(|(name, _, _)| name.to_owned())
        .collect();
    assert_eq!(on_disk, covered);
}

/// Reference §2.3: msgspec 0.23.0's bytes for the worked examples.
mod worked_examples {
    use super::*;

    pub const ALLOC_REQUEST: &str = "89 a474797065 ac416c6c6f6352657175657374
        a46b657973 92 a26b30 a26b31
        a3666d74 01
        a57368617065 94 02 20 cd0100 cd0400
        a56474797065 a862666c6f61743136
        af6c6173745f6368756e6b5f746f6b73 64
        a67265715f6964 a23137
        ad69735f6c6173745f6261746368 c2
        ac746f74616c5f6368756e6b73 05";
    pub const ALLOC_RESPONSE: &str = "83 a474797065 ad416c6c6f63526573706f6e7365
        ae72656d6f74655f696e6465786573 93 03 07 ff
        b4616c72656164795f73656e745f696e6465786573 90";
    pub const PROXY_NOTIF: &str = "82 a474797065 aa50726f78794e6f746966 a67265715f6964 a23137";
    pub const CANCEL_NOTIF: &str = "83 a474797065 ab43616e63656c4e6f746966
        a67265715f6964 a23137 a46b657973 91 a26b30";

    #[test]
    fn alloc_request_is_122_bytes() {
        let bytes = unhex(ALLOC_REQUEST);
        assert_eq!(bytes.len(), 122);
        let expected = Message::AllocRequest(AllocRequest {
            keys: strings(&["k0", "k1"]),
            fmt: 1,
            shape: vec![2, 32, 256, 1024],
            dtype: "bfloat16".to_owned(),
            last_chunk_toks: 100,
            req_id: "17".to_owned(),
            is_last_batch: false,
            total_chunks: 5,
            seq: None,
            chunk_bytes: None,
            claim: None,
        });
        assert_exact("§2.3 AllocRequest", &bytes, &expected);
    }

    #[test]
    fn alloc_response_with_minus_one() {
        assert_exact(
            "§2.3 AllocResponse",
            &unhex(ALLOC_RESPONSE),
            &alloc_response(&[3, 7, -1]),
        );
    }

    #[test]
    fn proxy_notif() {
        let expected = Message::ProxyNotif(ProxyNotif {
            req_id: "17".to_owned(),
        });
        assert_exact("§2.3 ProxyNotif", &unhex(PROXY_NOTIF), &expected);
    }

    #[test]
    fn cancel_notif() {
        let expected = Message::CancelNotif(CancelNotif {
            req_id: "17".to_owned(),
            keys: strings(&["k0"]),
            seq: None,
            drained: None,
        });
        assert_exact("§2.3 CancelNotif", &unhex(CANCEL_NOTIF), &expected);
    }
}

/// Reference §2.2: ints in their smallest form (256 → `cd 01 00`, 70000 → `ce 00 01 11 70`,
/// −1 → `ff`, −33 → `d0 df`).
#[test]
fn integers_use_the_smallest_form() {
    let msg = alloc_response(&[0, 127, 128, 256, 70000, -1, -32, -33, -129, 1 << 40]);
    let bytes = encode(&msg);
    let tail = unhex(
        "9a 00 7f cc80 cd0100 ce00011170 ff e0 d0df d1ff7f cf0000010000000000
         b4616c72656164795f73656e745f696e6465786573 90",
    );
    assert!(bytes.ends_with(&tail), "got {bytes:02x?}");
    assert_eq!(decode(&bytes).expect("decodes"), msg);
}

#[test]
fn extensions_round_trip_and_are_absent_when_unset() {
    let with_ext = [
        Message::AllocRequest(AllocRequest {
            keys: strings(&["pdsim@1@0@100000@bfloat16"]),
            fmt: 1,
            shape: vec![2, 2, 256, 64],
            dtype: "bfloat16".to_owned(),
            last_chunk_toks: 256,
            req_id: "r1".to_owned(),
            is_last_batch: true,
            total_chunks: 1,
            seq: Some(u64::MAX),
            chunk_bytes: Some(vec![1 << 40]),
            claim: None,
        }),
        Message::AllocResponse(AllocResponse::granted(
            vec![4, 5],
            Some(vec![7, 70000]),
            Some(9),
        )),
        Message::AllocResponse(AllocResponse::refused(
            3,
            "request larger than buffer".into(),
            Some(1),
        )),
        Message::CancelNotif(CancelNotif {
            req_id: "r1".to_owned(),
            keys: Vec::new(),
            seq: Some(300),
            drained: Some(true),
        }),
        Message::FailNotif(FailNotif {
            req_id: "r1".to_owned(),
            reason: "QP error".to_owned(),
        }),
    ];
    for msg in &with_ext {
        assert_eq!(&decode(&encode(msg)).expect("decodes"), msg);
    }
    // With every extension unset, kvx's bytes are LMCache's bytes (no extra keys).
    let plain = golden("alloc_response_ok.hex");
    assert_eq!(encode(&alloc_response(&[0, 1])), plain);
    for field in ["seq", "error", "generations", "drained"] {
        assert!(!contains(&plain, field.as_bytes()));
    }
}

/// An LMCache peer decodes kvx's extended messages with its own struct, which lacks the
/// extension fields: msgspec ignores unknown fields. Model that peer with serde structs that
/// mirror LMCache's classes exactly.
#[test]
fn lmcache_style_decoder_ignores_kvx_extensions() {
    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(tag = "type")]
    enum LmcacheMsg {
        AllocResponse {
            remote_indexes: Vec<i64>,
            already_sent_indexes: Vec<i64>,
        },
        CancelNotif {
            req_id: String,
            keys: Vec<String>,
        },
    }
    let kvx = Message::AllocResponse(AllocResponse::refused(2, "too big".into(), Some(3)));
    let seen: LmcacheMsg = rmp_serde::from_slice(&encode(&kvx)).expect("LMCache-style decode");
    assert_eq!(
        seen,
        LmcacheMsg::AllocResponse {
            remote_indexes: vec![-1, -1],
            already_sent_indexes: vec![]
        }
    );
    let kvx = Message::CancelNotif(CancelNotif {
        req_id: "r".into(),
        keys: strings(&["k"]),
        seq: Some(1),
        drained: Some(false),
    });
    let seen: LmcacheMsg = rmp_serde::from_slice(&encode(&kvx)).expect("LMCache-style decode");
    assert_eq!(
        seen,
        LmcacheMsg::CancelNotif {
            req_id: "r".into(),
            keys: strings(&["k"])
        }
    );
}

/// A newer peer's unknown fields (of any type, nested, before or after known ones, with the
/// tag last) are skipped.
#[test]
fn unknown_fields_are_ignored() {
    // {"future": {"a": [1, nil, 1.5, b"\x00"]}, "req_id": "17", "x": ext, "type": "ProxyNotif"}
    let bytes = unhex(
        "84 a6667574757265 81 a161 94 01 c0 cb3ff8000000000000 c40100
            a67265715f6964 a23137
            a178 d40102
            a474797065 aa50726f78794e6f746966",
    );
    let expected = Message::ProxyNotif(ProxyNotif {
        req_id: "17".to_owned(),
    });
    assert_eq!(decode(&bytes).expect("decodes"), expected);

    // The golden first batch with an extra trailing field `"priority": 3`.
    let mut extended = golden("alloc_request_first_batch.hex");
    extended[0] += 1;
    extended.extend_from_slice(&unhex("a87072696f72697479 03"));
    let (_, _, expected) = expectations().swap_remove(0);
    assert_eq!(decode(&extended).expect("decodes"), expected);
}

/// Defaults fill in when an LMCache sync-backend peer omits optional fields.
#[test]
fn defaults_fill_in_missing_optional_fields() {
    // {"type": "AllocRequest", "keys": [], "fmt": 1, "shape": [], "dtype": "", "last_chunk_toks": 0}
    let bytes = unhex(
        "86 a474797065 ac416c6c6f6352657175657374 a46b657973 90 a3666d74 01 a57368617065 90
            a56474797065 a0 af6c6173745f6368756e6b5f746f6b73 00",
    );
    let Message::AllocRequest(m) = decode(&bytes).expect("decodes") else {
        panic!("wrong type")
    };
    assert_eq!(
        (m.req_id.as_str(), m.is_last_batch, m.total_chunks, m.seq),
        ("", false, 0, None)
    );
    // {"type": "AllocResponse", "remote_indexes": [1]}
    let bytes =
        unhex("82 a474797065 ad416c6c6f63526573706f6e7365 ae72656d6f74655f696e6465786573 91 01");
    assert_eq!(decode(&bytes).expect("decodes"), alloc_response(&[1]));
}

#[test]
fn encode_into_appends_and_serde_derive_agrees() {
    let mut buf = b"prefix".to_vec();
    for (name, _, msg) in expectations() {
        buf.truncate(6);
        encode_into(&msg, &mut buf);
        assert_eq!(&buf[6..], golden(name), "{name}");
        // The derived Serialize (internally tagged, to_vec_named) writes the same bytes.
        assert_eq!(
            rmp_serde::to_vec_named(&msg).expect("serde encodes"),
            golden(name),
            "{name}"
        );
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
