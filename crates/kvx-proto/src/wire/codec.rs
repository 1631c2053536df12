//! Byte-exact msgpack codec for the LMCache PD messages (`docs/spec/wire.md`).
//!
//! Both directions are written by hand instead of going through serde:
//!
//! - **Encoding** writes what `msgspec.msgpack.encode` writes: a map, `"type"` first, then
//!   every field in declaration order with defaults included, integers in their smallest
//!   form. kvx extension fields that are `None` are left out (spec §1.6).
//! - **Decoding** follows `msgspec.msgpack.decode(bytes, type=PDMsg)` (spec §3.1): the tag may
//!   sit anywhere in the map, unknown fields are skipped, any integer width is accepted, and
//!   typing is strict (an int is not a bool, bin is not str). It never panics, never
//!   recurses on input, and never allocates more than a small multiple of the frame, because
//!   every length is checked against the bytes that are actually left.
//!
//! serde's internally tagged enums buffer the whole map into `Content` before choosing a
//! variant, and `String`'s visitor accepts bin as str, so the derived `Deserialize` is both
//! slower and laxer than msgspec (spec §5); it is kept for convenience only.

use rmp::Marker;

use super::{AllocRequest, AllocResponse, CancelNotif, FailNotif, Message, ProxyNotif};

/// Largest frame [`decode`] accepts: 1 MiB, far above any real batch (a 256-key
/// `AllocRequest` is about 7 KiB).
pub const DEFAULT_FRAME_MAX_BYTES: usize = 1 << 20;

/// Why bytes are not a valid kvx / LMCache PD message (spec §3.3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame is longer than the configured `frame_max_bytes`.
    #[error(
        "frame of {len} bytes exceeds the limit of {max} bytes; \
         raise frame_max_bytes if the peer legitimately sends batches this large"
    )]
    FrameTooLarge { len: usize, max: usize },
    /// The input ends inside a value, or a length prefix claims more than the frame holds.
    #[error(
        "truncated message: the value at byte {offset} needs more bytes than the frame holds \
         (was the frame cut short, or is it not msgpack?)"
    )]
    Truncated { offset: usize },
    /// The top-level value is not a msgpack map.
    #[error("a message must be a msgpack map, found {found}: is the peer speaking LMCache PD?")]
    NotAMap { found: &'static str },
    /// The map has no `"type"` key.
    #[error("the message map has no \"type\" key, so its message type is unknown")]
    MissingType,
    /// The `"type"` names no message kvx knows.
    #[error(
        "unknown message type {0:?}; kvx knows AllocRequest, AllocResponse, ProxyNotif, \
         CancelNotif and FailNotif (is the peer a newer or different protocol?)"
    )]
    UnknownType(String),
    /// A required field is absent.
    #[error("{message} lacks its required field `{field}`")]
    MissingField {
        message: &'static str,
        field: &'static str,
    },
    /// A value has the wrong msgpack type (msgspec is strict: int is not bool, bin is not str).
    #[error("`{path}`: expected {expected}, found {found}")]
    WrongType {
        path: String,
        expected: &'static str,
        found: &'static str,
    },
    /// An integer does not fit the field's Rust type (e.g. a negative `total_chunks`).
    #[error("`{path}`: {value} is out of range for {expected}")]
    IntOutOfRange {
        path: String,
        value: i128,
        expected: &'static str,
    },
    /// A msgpack str holds bytes that are not UTF-8.
    #[error("`{path}`: string is not valid UTF-8")]
    InvalidUtf8 { path: String },
    /// Bytes follow the end of the message.
    #[error("{len} unexpected bytes after the end of the message at byte {offset}")]
    TrailingBytes { offset: usize, len: usize },
    /// Anything else that is not msgpack or not a consistent message.
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Internally errors are boxed: `DecodeError` is about 64 bytes, and every read returns a
/// `Result`, so a thin error pointer keeps the hot path's results in registers.
type Result<T> = std::result::Result<T, Box<DecodeError>>;

// ---- Encoding ---------------------------------------------------------------------------

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
    header(out, 8 + count_some(&[m.seq.is_some()]), "AllocRequest");
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
}

fn encode_alloc_response(m: &AllocResponse, out: &mut Vec<u8>) {
    let extensions = [m.seq.is_some(), m.error.is_some(), m.generations.is_some()];
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
}

/// A capacity guess that avoids regrowing the buffer for typical messages.
fn encoded_len_hint(msg: &Message) -> usize {
    let strs = |v: &[String]| v.iter().map(|s| s.len() + 2).sum::<usize>();
    match msg {
        Message::AllocRequest(m) => {
            160 + strs(&m.keys) + m.shape.len() * 9 + m.dtype.len() + m.req_id.len()
        }
        Message::AllocResponse(m) => {
            96 + (m.remote_indexes.len() + m.already_sent_indexes.len()) * 9
                + m.error.as_ref().map_or(0, String::len)
                + m.generations.as_ref().map_or(0, |g| g.len() * 5)
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

// ---- Decoding ---------------------------------------------------------------------------

/// Decodes one message, refusing frames over [`DEFAULT_FRAME_MAX_BYTES`].
pub fn decode(bytes: &[u8]) -> std::result::Result<Message, DecodeError> {
    decode_with_limit(bytes, DEFAULT_FRAME_MAX_BYTES)
}

/// Decodes one message, refusing frames over `frame_max_bytes`.
///
/// The whole input must be one msgpack map; trailing bytes are an error.
pub fn decode_with_limit(
    bytes: &[u8],
    frame_max_bytes: usize,
) -> std::result::Result<Message, DecodeError> {
    let (len, max) = (bytes.len(), frame_max_bytes);
    if len > max {
        return Err(DecodeError::FrameTooLarge { len, max });
    }
    decode_frame(bytes).map_err(|e| *e)
}

fn decode_frame(bytes: &[u8]) -> Result<Message> {
    let mut r = Reader { buf: bytes, pos: 0 };
    let entries = r.top_level_map_len()?;
    let body = r.pos;
    let type_name = r.find_type(entries)?;
    r.pos = body;
    let msg = match type_name {
        "AllocRequest" => Message::AllocRequest(decode_alloc_request(&mut r, entries)?),
        "AllocResponse" => Message::AllocResponse(decode_alloc_response(&mut r, entries)?),
        "ProxyNotif" => Message::ProxyNotif(decode_proxy_notif(&mut r, entries)?),
        "CancelNotif" => Message::CancelNotif(decode_cancel_notif(&mut r, entries)?),
        "FailNotif" => Message::FailNotif(decode_fail_notif(&mut r, entries)?),
        other => return Err(DecodeError::UnknownType(other.to_owned()).into()),
    };
    if r.pos != bytes.len() {
        let trailing = DecodeError::TrailingBytes {
            offset: r.pos,
            len: bytes.len() - r.pos,
        };
        return Err(trailing.into());
    }
    Ok(msg)
}

/// Names a value in error messages, msgspec-style: `AllocRequest.keys`; [`Reader::list`]
/// appends the element index (`AllocRequest.keys[3]`).
type Path = &'static str;

#[cold]
fn missing(message: &'static str, field: &'static str) -> Box<DecodeError> {
    Box::new(DecodeError::MissingField { message, field })
}

fn decode_alloc_request(r: &mut Reader<'_>, entries: usize) -> Result<AllocRequest> {
    const M: &str = "AllocRequest";
    let (mut keys, mut fmt, mut shape, mut dtype, mut last_chunk_toks) =
        (None, None, None, None, None);
    let mut m = AllocRequest {
        keys: Vec::new(),
        fmt: 0,
        shape: Vec::new(),
        dtype: String::new(),
        last_chunk_toks: 0,
        req_id: String::new(),
        is_last_batch: false,
        total_chunks: 0,
        seq: None,
    };
    for _ in 0..entries {
        match r.key(M)? {
            b"type" => r.confirm_type(M)?,
            b"keys" => keys = Some(r.str_list("AllocRequest.keys")?),
            b"fmt" => fmt = Some(r.u32("AllocRequest.fmt")?),
            b"shape" => shape = Some(r.list("AllocRequest.shape", Reader::u64)?),
            b"dtype" => dtype = Some(r.string("AllocRequest.dtype")?),
            b"last_chunk_toks" => last_chunk_toks = Some(r.u64("AllocRequest.last_chunk_toks")?),
            b"req_id" => m.req_id = r.string("AllocRequest.req_id")?,
            b"is_last_batch" => m.is_last_batch = r.bool("AllocRequest.is_last_batch")?,
            b"total_chunks" => m.total_chunks = r.u32("AllocRequest.total_chunks")?,
            b"seq" => m.seq = r.optional("AllocRequest.seq", Reader::u64)?,
            unknown => r.skip_unknown(M, unknown)?,
        }
    }
    m.keys = keys.ok_or_else(|| missing(M, "keys"))?;
    m.fmt = fmt.ok_or_else(|| missing(M, "fmt"))?;
    m.shape = shape.ok_or_else(|| missing(M, "shape"))?;
    m.dtype = dtype.ok_or_else(|| missing(M, "dtype"))?;
    m.last_chunk_toks = last_chunk_toks.ok_or_else(|| missing(M, "last_chunk_toks"))?;
    Ok(m)
}

fn decode_alloc_response(r: &mut Reader<'_>, entries: usize) -> Result<AllocResponse> {
    const M: &str = "AllocResponse";
    let mut remote_indexes = None;
    let mut m = AllocResponse::granted(Vec::new(), None, None);
    for _ in 0..entries {
        match r.key(M)? {
            b"type" => r.confirm_type(M)?,
            b"remote_indexes" => {
                remote_indexes = Some(r.list("AllocResponse.remote_indexes", Reader::i64)?);
            }
            b"already_sent_indexes" => {
                m.already_sent_indexes =
                    r.list("AllocResponse.already_sent_indexes", Reader::i64)?;
            }
            b"seq" => m.seq = r.optional("AllocResponse.seq", Reader::u64)?,
            b"error" => m.error = r.optional("AllocResponse.error", Reader::string)?,
            b"generations" => {
                m.generations = r.optional("AllocResponse.generations", Reader::u32_list)?;
            }
            unknown => r.skip_unknown(M, unknown)?,
        }
    }
    m.remote_indexes = remote_indexes.ok_or_else(|| missing(M, "remote_indexes"))?;
    Ok(m)
}

fn decode_proxy_notif(r: &mut Reader<'_>, entries: usize) -> Result<ProxyNotif> {
    const M: &str = "ProxyNotif";
    let mut req_id = None;
    for _ in 0..entries {
        match r.key(M)? {
            b"type" => r.confirm_type(M)?,
            b"req_id" => req_id = Some(r.string("ProxyNotif.req_id")?),
            unknown => r.skip_unknown(M, unknown)?,
        }
    }
    Ok(ProxyNotif {
        req_id: req_id.ok_or_else(|| missing(M, "req_id"))?,
    })
}

fn decode_cancel_notif(r: &mut Reader<'_>, entries: usize) -> Result<CancelNotif> {
    const M: &str = "CancelNotif";
    let (mut req_id, mut keys, mut seq, mut drained) = (None, None, None, None);
    for _ in 0..entries {
        match r.key(M)? {
            b"type" => r.confirm_type(M)?,
            b"req_id" => req_id = Some(r.string("CancelNotif.req_id")?),
            b"keys" => keys = Some(r.str_list("CancelNotif.keys")?),
            b"seq" => seq = r.optional("CancelNotif.seq", Reader::u64)?,
            b"drained" => drained = r.optional("CancelNotif.drained", Reader::bool)?,
            unknown => r.skip_unknown(M, unknown)?,
        }
    }
    Ok(CancelNotif {
        req_id: req_id.ok_or_else(|| missing(M, "req_id"))?,
        keys: keys.ok_or_else(|| missing(M, "keys"))?,
        seq,
        drained,
    })
}

fn decode_fail_notif(r: &mut Reader<'_>, entries: usize) -> Result<FailNotif> {
    const M: &str = "FailNotif";
    let (mut req_id, mut reason) = (None, None);
    for _ in 0..entries {
        match r.key(M)? {
            b"type" => r.confirm_type(M)?,
            b"req_id" => req_id = Some(r.string("FailNotif.req_id")?),
            b"reason" => reason = Some(r.string("FailNotif.reason")?),
            unknown => r.skip_unknown(M, unknown)?,
        }
    }
    Ok(FailNotif {
        req_id: req_id.ok_or_else(|| missing(M, "req_id"))?,
        reason: reason.ok_or_else(|| missing(M, "reason"))?,
    })
}

/// A cursor over one frame. Every read checks the bytes left first, so no input can make it
/// index out of bounds, and every length prefix is checked against the bytes left before
/// anything is allocated for it.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

// The small readers are `#[inline(always)]` and the error constructors `#[cold]`: on the
// 16-key `AllocRequest` bench this took decode from about 920 ns to about 800 ns.
impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[cold]
    fn truncated(&self, offset: usize) -> Box<DecodeError> {
        Box::new(DecodeError::Truncated { offset })
    }

    #[inline(always)]
    fn peek(&self) -> Result<u8> {
        match self.buf.get(self.pos) {
            Some(&byte) => Ok(byte),
            None => Err(self.truncated(self.pos)),
        }
    }

    #[inline(always)]
    fn take(&mut self, n: usize, value_start: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.truncated(value_start));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    #[inline(always)]
    fn be<const N: usize>(&mut self, value_start: usize) -> Result<[u8; N]> {
        let bytes = self.take(N, value_start)?;
        let mut arr = [0u8; N];
        arr.copy_from_slice(bytes);
        Ok(arr)
    }

    #[inline(always)]
    /// Reads a big-endian length of 1, 2 or 4 bytes.
    fn length(&mut self, width: u8, value_start: usize) -> Result<usize> {
        Ok(match width {
            1 => usize::from(self.be::<1>(value_start)?[0]),
            2 => usize::from(u16::from_be_bytes(self.be(value_start)?)),
            _ => u32::from_be_bytes(self.be(value_start)?) as usize,
        })
    }

    #[inline(always)]
    /// Reads a marker byte, returning it with the offset where its value starts.
    fn marker(&mut self) -> Result<(Marker, usize)> {
        let start = self.pos;
        let byte = self.peek()?;
        self.pos += 1;
        Ok((Marker::from_u8(byte), start))
    }

    fn top_level_map_len(&mut self) -> Result<usize> {
        let (marker, start) = self.marker()?;
        let len = match marker {
            Marker::FixMap(n) => usize::from(n),
            Marker::Map16 => self.length(2, start)?,
            Marker::Map32 => self.length(4, start)?,
            other => {
                return Err(Box::new(DecodeError::NotAMap {
                    found: describe(other),
                }))
            }
        };
        // Every entry takes at least two bytes, so a longer claim cannot be honest.
        if len > self.remaining() / 2 {
            return Err(self.truncated(start));
        }
        Ok(len)
    }

    /// Scans the map for `"type"` without decoding anything else (msgspec allows the tag
    /// anywhere; LMCache and kvx put it first, so this usually stops at the first entry).
    fn find_type(&mut self, entries: usize) -> Result<&'a str> {
        for _ in 0..entries {
            if self.key("message")? == b"type" {
                return self.str_value("message.type");
            }
            self.skip_value()?;
        }
        Err(Box::new(DecodeError::MissingType))
    }

    /// A later `"type"` entry must repeat the one [`Self::find_type`] found.
    fn confirm_type(&mut self, expected: &'static str) -> Result<()> {
        let found = self.str_value("message.type")?;
        if found == expected {
            return Ok(());
        }
        let what = format!("conflicting \"type\" entries {expected:?} and {found:?}");
        Err(Box::new(DecodeError::Malformed(what)))
    }

    /// A map key: msgspec requires str keys for struct maps. Known keys are matched as
    /// bytes; [`Self::skip_unknown`] checks the UTF-8 of the others.
    fn key(&mut self, message: &'static str) -> Result<&'a [u8]> {
        self.str_bytes("<map key>")
            .map_err(|e| prefix_path(e, message))
    }

    /// Skips the value of a field this message does not have (msgspec ignores unknown
    /// fields), after checking that its key is a valid str.
    fn skip_unknown(&mut self, message: &'static str, key: &[u8]) -> Result<()> {
        if std::str::from_utf8(key).is_err() {
            let path = format!("{message}.<map key>");
            return Err(Box::new(DecodeError::InvalidUtf8 { path }));
        }
        self.skip_value()
    }

    #[inline(always)]
    /// The bytes of a msgpack str, not yet checked for UTF-8.
    fn str_bytes(&mut self, path: Path) -> Result<&'a [u8]> {
        let (marker, start) = self.marker()?;
        let len = match marker {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => self.length(1, start)?,
            Marker::Str16 => self.length(2, start)?,
            Marker::Str32 => self.length(4, start)?,
            other => return Err(wrong_type(path, "str", other)),
        };
        self.take(len, start)
    }

    #[inline(always)]
    fn str_value(&mut self, path: Path) -> Result<&'a str> {
        let bytes = self.str_bytes(path)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s),
            Err(_) => Err(Box::new(DecodeError::InvalidUtf8 {
                path: path.to_owned(),
            })),
        }
    }

    fn string(&mut self, path: Path) -> Result<String> {
        self.str_value(path).map(str::to_owned)
    }

    fn str_list(&mut self, path: Path) -> Result<Vec<String>> {
        self.list(path, Reader::string)
    }

    fn bool(&mut self, path: Path) -> Result<bool> {
        match self.marker()?.0 {
            Marker::True => Ok(true),
            Marker::False => Ok(false),
            other => Err(wrong_type(path, "bool", other)),
        }
    }

    #[inline(always)]
    /// Any msgpack integer width, widened so every u64 and i64 fits.
    fn int(&mut self, path: Path) -> Result<i128> {
        let (marker, start) = self.marker()?;
        Ok(match marker {
            Marker::FixPos(n) => i128::from(n),
            Marker::FixNeg(n) => i128::from(n),
            Marker::U8 => i128::from(self.be::<1>(start)?[0]),
            Marker::U16 => i128::from(u16::from_be_bytes(self.be(start)?)),
            Marker::U32 => i128::from(u32::from_be_bytes(self.be(start)?)),
            Marker::U64 => i128::from(u64::from_be_bytes(self.be(start)?)),
            Marker::I8 => i128::from(i8::from_be_bytes(self.be(start)?)),
            Marker::I16 => i128::from(i16::from_be_bytes(self.be(start)?)),
            Marker::I32 => i128::from(i32::from_be_bytes(self.be(start)?)),
            Marker::I64 => i128::from(i64::from_be_bytes(self.be(start)?)),
            other => return Err(wrong_type(path, "int", other)),
        })
    }

    fn u64(&mut self, path: Path) -> Result<u64> {
        let v = self.int(path)?;
        u64::try_from(v).map_err(|_| out_of_range(path, v, "an unsigned 64-bit int"))
    }

    fn u32(&mut self, path: Path) -> Result<u32> {
        let v = self.int(path)?;
        u32::try_from(v).map_err(|_| out_of_range(path, v, "an unsigned 32-bit int"))
    }

    fn i64(&mut self, path: Path) -> Result<i64> {
        let v = self.int(path)?;
        i64::try_from(v).map_err(|_| out_of_range(path, v, "a signed 64-bit int"))
    }

    /// A kvx extension field: nil reads as absent, as msgspec does for `Optional[...]`.
    fn optional<T>(&mut self, path: Path, read: ReadFn<'a, T>) -> Result<Option<T>> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(None);
        }
        read(self, path).map(Some)
    }

    fn list<T>(&mut self, path: Path, read: ReadFn<'a, T>) -> Result<Vec<T>> {
        let (marker, start) = self.marker()?;
        let len = match marker {
            Marker::FixArray(n) => usize::from(n),
            Marker::Array16 => self.length(2, start)?,
            Marker::Array32 => self.length(4, start)?,
            other => return Err(wrong_type(path, "array", other)),
        };
        // Every element takes at least one byte: this bounds the allocation by the frame.
        if len > self.remaining() {
            return Err(self.truncated(start));
        }
        let mut items = Vec::with_capacity(len);
        for i in 0..len {
            items.push(read(self, path).map_err(|e| index_path(e, i))?);
        }
        Ok(items)
    }

    fn u32_list(&mut self, path: Path) -> Result<Vec<u32>> {
        self.list(path, Reader::u32)
    }

    /// Skips one value of any type, iteratively: a frame of nested one-element arrays costs
    /// a counter, not a stack frame per level.
    fn skip_value(&mut self) -> Result<()> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let (marker, start) = self.marker()?;
            let (payload, children) = match marker {
                Marker::FixPos(_) | Marker::FixNeg(_) => (0, 0),
                Marker::Null | Marker::True | Marker::False => (0, 0),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(n) => (usize::from(n), 0),
                Marker::Str8 | Marker::Bin8 => (self.length(1, start)?, 0),
                Marker::Str16 | Marker::Bin16 => (self.length(2, start)?, 0),
                Marker::Str32 | Marker::Bin32 => (self.length(4, start)?, 0),
                // Extensions carry a type byte before their data.
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (self.length(1, start)? + 1, 0),
                Marker::Ext16 => (self.length(2, start)? + 1, 0),
                Marker::Ext32 => (self.length(4, start)? + 1, 0),
                Marker::FixArray(n) => (0, u64::from(n)),
                Marker::Array16 => (0, self.length(2, start)? as u64),
                Marker::Array32 => (0, self.length(4, start)? as u64),
                Marker::FixMap(n) => (0, 2 * u64::from(n)),
                Marker::Map16 => (0, 2 * self.length(2, start)? as u64),
                Marker::Map32 => (0, 2 * self.length(4, start)? as u64),
                Marker::Reserved => {
                    let what = format!("byte 0xc1 at offset {start} is not a msgpack type marker");
                    return Err(Box::new(DecodeError::Malformed(what)));
                }
            };
            self.take(payload, start)?;
            pending += children;
            // Each pending value needs at least one byte; fail now rather than loop.
            if pending > self.remaining() as u64 {
                return Err(self.truncated(start));
            }
        }
        Ok(())
    }
}

/// How [`Reader::list`] and [`Reader::optional`] read one inner value. A plain `fn` pointer
/// keeps the element path a `&'static str` and the readers small.
type ReadFn<'a, T> = fn(&mut Reader<'a>, Path) -> Result<T>;

#[cold]
fn wrong_type(path: Path, expected: &'static str, found: Marker) -> Box<DecodeError> {
    let found = describe(found);
    Box::new(DecodeError::WrongType {
        path: path.to_owned(),
        expected,
        found,
    })
}

#[cold]
fn out_of_range(path: Path, value: i128, expected: &'static str) -> Box<DecodeError> {
    Box::new(DecodeError::IntOutOfRange {
        path: path.to_owned(),
        value,
        expected,
    })
}

/// The path inside an error, if it has one.
fn error_path(e: &mut DecodeError) -> Option<&mut String> {
    match e {
        DecodeError::WrongType { path, .. }
        | DecodeError::IntOutOfRange { path, .. }
        | DecodeError::InvalidUtf8 { path } => Some(path),
        _ => None,
    }
}

/// Names the list element an error happened in: `AllocRequest.keys` → `AllocRequest.keys[3]`.
/// Paths are completed on the error path only, so reads pass a plain `&'static str`.
fn index_path(mut e: Box<DecodeError>, index: usize) -> Box<DecodeError> {
    if let Some(path) = error_path(&mut e) {
        path.push_str(&format!("[{index}]"));
    }
    e
}

/// Puts the message name in front of a path: `<map key>` → `AllocRequest.<map key>`.
fn prefix_path(mut e: Box<DecodeError>, message: &'static str) -> Box<DecodeError> {
    if let Some(path) = error_path(&mut e) {
        path.insert_str(0, &format!("{message}."));
    }
    e
}

/// The msgpack type of a marker, in the words msgspec's errors use.
fn describe(marker: Marker) -> &'static str {
    match marker {
        Marker::FixPos(_) | Marker::FixNeg(_) => "int",
        Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => "int",
        Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => "int",
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "str",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bin",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::FixExt1 | Marker::FixExt2 | Marker::FixExt4 => "ext",
        Marker::FixExt8 | Marker::FixExt16 => "ext",
        Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => "ext",
        Marker::Reserved => "the reserved byte 0xc1",
    }
}
