//! Encoding: writes what `msgspec.msgpack.encode` writes — a map, `"type"` first, then every
//! field in declaration order with defaults included, integers in their smallest form. kvx
//! extension fields that are `None` are left out (`docs/spec/wire.md`).

use super::{AllocRequest, AllocResponse, Message};

/// Encodes `msg` exactly as LMCache's msgspec encoder would (plus any kvx extension fields
/// that are set).
pub fn encode(msg: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(encoded_len_hint(msg));
    encode_into(msg, &mut out);
    out
}

/// Appends the encoding of `msg` to `out`; clear `out` first to reuse a buffer.
pub fn encode_into(msg: &Message, out: &mut Vec<u8>) {
    out.reserve(encoded_len_hint(msg));
    match msg {
        Message::AllocRequest(m) => encode_alloc_request(m, out),
        Message::AllocResponse(m) => encode_alloc_response(m, out),
        Message::ProxyNotif(m) => {
            header(out, 1, "ProxyNotif");
            field_str(out, "req_id", &m.req_id);
        }
        Message::CancelNotif(m) => {
            let extensions = [m.seq.is_some(), m.drained.is_some()];
            header(out, 2 + count_some(&extensions), "CancelNotif");
            field_str(out, "req_id", &m.req_id);
            field_list(out, "keys", &m.keys, |out, k| write_str(out, k));
            if let Some(seq) = m.seq {
                field_uint(out, "seq", seq);
            }
            if let Some(drained) = m.drained {
                field_bool(out, "drained", drained);
            }
        }
        Message::FailNotif(m) => {
            header(out, 2, "FailNotif");
            field_str(out, "req_id", &m.req_id);
            field_str(out, "reason", &m.reason);
        }
    }
}

fn encode_alloc_request(m: &AllocRequest, out: &mut Vec<u8>) {
    let extensions = [m.seq.is_some(), m.chunk_bytes.is_some(), m.claim.is_some()];
    header(out, 8 + count_some(&extensions), "AllocRequest");
    field_list(out, "keys", &m.keys, |out, k| write_str(out, k));
    field_uint(out, "fmt", u64::from(m.fmt));
    field_list(out, "shape", &m.shape, |out, &dim| write_uint(out, dim));
    field_str(out, "dtype", &m.dtype);
    field_uint(out, "last_chunk_toks", m.last_chunk_toks);
    field_str(out, "req_id", &m.req_id);
    field_bool(out, "is_last_batch", m.is_last_batch);
    field_uint(out, "total_chunks", u64::from(m.total_chunks));
    if let Some(seq) = m.seq {
        field_uint(out, "seq", seq);
    }
    if let Some(bytes) = &m.chunk_bytes {
        field_list(out, "chunk_bytes", bytes, |out, &b| write_uint(out, b));
    }
    if let Some(claim) = &m.claim {
        field_str(out, "claim", claim.expose());
    }
}

fn encode_alloc_response(m: &AllocResponse, out: &mut Vec<u8>) {
    let extensions = [
        m.seq.is_some(),
        m.error.is_some(),
        m.generations.is_some(),
        m.fabric_credential.is_some(),
        m.request_idle_timeout_ms.is_some(),
        m.write_quarantine_ms.is_some(),
    ];
    header(out, 2 + count_some(&extensions), "AllocResponse");
    field_list(out, "remote_indexes", &m.remote_indexes, |out, &i| {
        write_sint(out, i)
    });
    field_list(
        out,
        "already_sent_indexes",
        &m.already_sent_indexes,
        |out, &i| write_sint(out, i),
    );
    if let Some(seq) = m.seq {
        field_uint(out, "seq", seq);
    }
    if let Some(error) = &m.error {
        field_str(out, "error", error);
    }
    if let Some(generations) = &m.generations {
        field_list(out, "generations", generations, |out, &g| {
            write_uint(out, u64::from(g))
        });
    }
    if let Some(credential) = &m.fabric_credential {
        field_str(out, "fabric_credential", credential);
    }
    if let Some(ms) = m.request_idle_timeout_ms {
        field_uint(out, "request_idle_timeout_ms", ms);
    }
    if let Some(ms) = m.write_quarantine_ms {
        field_uint(out, "write_quarantine_ms", ms);
    }
}

/// A capacity guess that avoids regrowing the buffer for typical messages.
fn encoded_len_hint(msg: &Message) -> usize {
    let strs = |v: &[String]| v.iter().map(|s| s.len() + 2).sum::<usize>();
    match msg {
        Message::AllocRequest(m) => {
            160 + strs(&m.keys)
                + (m.shape.len() + m.chunk_bytes.as_ref().map_or(0, Vec::len)) * 9
                + m.dtype.len()
                + m.req_id.len()
                + m.claim.as_ref().map_or(0, |c| c.expose().len() + 8)
        }
        Message::AllocResponse(m) => {
            96 + (m.remote_indexes.len() + m.already_sent_indexes.len()) * 9
                + m.error.as_ref().map_or(0, String::len)
                + m.generations.as_ref().map_or(0, |g| g.len() * 5)
                + m.fabric_credential.as_ref().map_or(0, |c| c.len() + 20)
                + 60
        }
        Message::ProxyNotif(m) => 32 + m.req_id.len(),
        Message::CancelNotif(m) => 64 + m.req_id.len() + strs(&m.keys),
        Message::FailNotif(m) => 48 + m.req_id.len() + m.reason.len(),
    }
}

/// How many of a message's optional fields are set, i.e. will be written.
fn count_some(present: &[bool]) -> usize {
    present.iter().filter(|&&p| p).count()
}

/// The map header plus the `"type"` entry, which msgspec always writes first.
fn header(out: &mut Vec<u8>, fields: usize, type_name: &str) {
    write_map_len(out, fields + 1);
    write_str(out, "type");
    write_str(out, type_name);
}

fn field_str(out: &mut Vec<u8>, name: &str, value: &str) {
    write_str(out, name);
    write_str(out, value);
}

fn field_uint(out: &mut Vec<u8>, name: &str, value: u64) {
    write_str(out, name);
    write_uint(out, value);
}

fn field_bool(out: &mut Vec<u8>, name: &str, value: bool) {
    write_str(out, name);
    out.push(if value { 0xc3 } else { 0xc2 });
}

fn field_list<T>(out: &mut Vec<u8>, name: &str, values: &[T], write: fn(&mut Vec<u8>, &T)) {
    write_str(out, name);
    write_array_len(out, values.len());
    for v in values {
        write(out, v);
    }
}

/// msgpack cannot express a length of 2^32 or more; no message comes near it, since the
/// receiving side refuses frames over `frame_max_bytes` anyway.
fn wire_len(len: usize) -> u32 {
    u32::try_from(len).expect("invariant: wire strings and lists are shorter than 2^32")
}

fn write_len(out: &mut Vec<u8>, len: usize, fix_base: u8, fix_max: usize, m16: u8, m32: u8) {
    if len <= fix_max {
        out.push(fix_base | len as u8);
    } else if len <= usize::from(u16::MAX) {
        out.push(m16);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(m32);
        out.extend_from_slice(&wire_len(len).to_be_bytes());
    }
}

fn write_map_len(out: &mut Vec<u8>, len: usize) {
    write_len(out, len, 0x80, 15, 0xde, 0xdf);
}

fn write_array_len(out: &mut Vec<u8>, len: usize) {
    write_len(out, len, 0x90, 15, 0xdc, 0xdd);
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    let len = s.len();
    if len <= 31 {
        out.push(0xa0 | len as u8);
    } else if len <= usize::from(u8::MAX) {
        out.extend_from_slice(&[0xd9, len as u8]);
    } else {
        write_len(out, len, 0xa0, 0, 0xda, 0xdb);
    }
    out.extend_from_slice(s.as_bytes());
}

/// Smallest unsigned form, as msgspec writes non-negative ints.
fn write_uint(out: &mut Vec<u8>, v: u64) {
    if v < 128 {
        out.push(v as u8);
    } else if v <= u64::from(u8::MAX) {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= u64::from(u16::MAX) {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u64::from(u32::MAX) {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// Smallest form for a signed value: non-negative values use the unsigned forms, as msgspec
/// does (−1 → `ff`, −33 → `d0 df`).
fn write_sint(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        write_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as u8);
    } else if v >= i64::from(i8::MIN) {
        out.extend_from_slice(&[0xd0, v as u8]);
    } else if v >= i64::from(i16::MIN) {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= i64::from(i32::MIN) {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}
