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


def chunk_bytes(req_id: str, chunk: int, nbytes: int) -> np.ndarray:
    """The bytes of chunk `chunk` of request `req_id` (`nbytes` a multiple of 4 KiB)."""
    assert nbytes % (BLOCK_WORDS * 8) == 0, "whole 4 KiB blocks only"
    key = _chunk_key(req_id, chunk)
    blocks = nbytes // (BLOCK_WORDS * 8)
    keys = np.array(
        [key ^ ((b * 0xD6E8FEB86659FD93) & M64) for b in range(blocks)], dtype=np.uint64
    )
    words = (BASE[None, :] ^ keys[:, None]).astype("<u8")
    return words.reshape(-1).view(np.uint8)
