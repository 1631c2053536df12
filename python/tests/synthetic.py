"""kvx's synthetic workload bytes (crates/kvx-node/src/synthetic.rs), in NumPy: each chunk's
bytes derive from (request id, chunk index), so that a `kvx receiver` process checks every
byte a Python sender wrote. Chunks here are whole 4 KiB blocks."""

import numpy as np

M64 = (1 << 64) - 1
BLOCK_WORDS = 512


def _base_block() -> np.ndarray:
    x, out = 0x5EED, []
    for _ in range(BLOCK_WORDS):
        x = (x + 0x9E3779B97F4A7C15) & M64
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return np.array(out, dtype=np.uint64)


BASE = _base_block()


def _chunk_key(req_id: str, chunk: int) -> int:
    h = 0xCBF29CE484222325
    for b in req_id.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return (((h ^ ((chunk * 0x9E3779B97F4A7C15) & M64)) * 0xBF58476D1CE4E5B9) & M64) | 1


def _block_keys(req_id: str, chunk: int, blocks: int) -> np.ndarray:
    key = np.uint64(_chunk_key(req_id, chunk))
    # uint64 arithmetic wraps in NumPy arrays, as in Rust's wrapping_mul.
    return key ^ (np.arange(blocks, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93))


def _words(buf, nbytes: int) -> np.ndarray:
    assert nbytes % (BLOCK_WORDS * 8) == 0, "whole 4 KiB blocks only"
    return np.frombuffer(buf, dtype="<u8", count=nbytes // 8).reshape(-1, BLOCK_WORDS)


def fill(req_id: str, chunk: int, out, nbytes: int) -> None:
    """Writes chunk `chunk` of request `req_id` into the first `nbytes` of the writable
    buffer `out` (a slot's view), in one pass."""
    words = _words(out, nbytes)
    np.bitwise_xor(BASE[None, :], _block_keys(req_id, chunk, words.shape[0])[:, None], out=words)


def matches(req_id: str, chunk: int, got, nbytes: int, scratch: np.ndarray) -> bool:
    """True when the first `nbytes` of `got` hold exactly chunk `chunk` of `req_id`;
    `scratch` is a uint64 array of at least nbytes / 8 words, reused between calls."""
    words = _words(got, nbytes)
    tmp = scratch[: words.size].reshape(words.shape)
    np.bitwise_xor(words, _block_keys(req_id, chunk, words.shape[0])[:, None], out=tmp)
    return bool(np.array_equal(tmp, np.broadcast_to(BASE, tmp.shape)))


def chunk_bytes(req_id: str, chunk: int, nbytes: int) -> np.ndarray:
    """The bytes of chunk `chunk` of request `req_id` (`nbytes` a multiple of 4 KiB)."""
    out = np.empty(nbytes, dtype=np.uint8)
    fill(req_id, chunk, out, nbytes)
    return out
