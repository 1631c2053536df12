"""An LMCache-style sender, built on pyzmq + msgspec with LMCache's message definitions,
talking to `kvx receiver` exactly as LMCache's PDBackendAsync sender does: a DEALER with
identity "<local_id>-to-<receiver_id>", frames ["", msgpack(PDMsg)], one message in flight.

Usage: python3 lmcache_sender.py tcp://127.0.0.1:PORT GOLDEN_DIR
Exits 0 when every check passes; prints what failed otherwise.
"""

import sys
from typing import Optional, Union

import msgspec
import zmq


# LMCache's wire classes (lmcache/v1/storage_backend/pd_backend_async.py, as described in
# shared/reference/lmcache-pd.md §2.1): a tagged union, tag field "type", class-name tags.
class PDMsgBase(msgspec.Struct, tag=True):
    pass


class AllocRequest(PDMsgBase):
    keys: list[str]
    fmt: int
    shape: list[int]
    dtype: str
    last_chunk_toks: int
    req_id: str = ""
    is_last_batch: bool = False
    total_chunks: int = 0


class AllocResponse(PDMsgBase):
    remote_indexes: list[int]
    already_sent_indexes: list[int] = []


class ProxyNotif(PDMsgBase):
    req_id: str


class CancelNotif(PDMsgBase):
    req_id: str
    keys: list[str]


PDMsg = Union[AllocRequest, AllocResponse, ProxyNotif, CancelNotif]

TIMEOUT_MS = 10_000


def main() -> int:
    endpoint, golden_dir = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"sender-pid1-abcd1234-to-127.0.0.18300")
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    failures = []

    def rpc(msg) -> tuple[AllocResponse, bytes]:
        sock.send_multipart([b"", msgspec.msgpack.encode(msg)])
        frames = sock.recv_multipart()
        raw = frames[-1]
        reply = msgspec.msgpack.decode(raw, type=PDMsg)
        if not isinstance(reply, AllocResponse):
            failures.append(f"reply to {type(msg).__name__} is {type(reply).__name__}")
        return reply, raw

    def check(cond: bool, what: str):
        if not cond:
            failures.append(what)

    def batch(req, keys, total, last=False, toks=256):
        return AllocRequest(keys=keys, fmt=1, shape=[2, 2, 256, 64], dtype="bfloat16",
                            last_chunk_toks=toks, req_id=req, is_last_batch=last, total_chunks=total)

    keys = [f"pdsim@1@0@{100000 + i}@bfloat16" for i in range(5)]
    if len(sys.argv) > 3 and sys.argv[3] == "expect-refusal":
        # A receiver that refuses legacy senders (the default) answers LMCache-shaped, with
        # LMCache's exact bytes, and grants nothing.
        r, raw = rpc(batch("s0-r001-n5-t100", keys[0:2], 5))
        check(r.remote_indexes == [-1, -1], f"legacy sender refused: {r}")
        golden = bytes.fromhex(open(f"{golden_dir}/alloc_response_minus1.hex").read().strip())
        check(raw == golden, f"refusal bytes are LMCache's exactly: {raw.hex()}")
        sock.close()
        ctx.term()
        for f in failures:
            print("FAIL:", f)
        print(f"lmcache_sender: {2 - len(failures)} passed, {len(failures)} failed")
        return 1 if failures else 0

    # R1: 5 chunks in batches of 2 + 2 + 1, as in the golden capture.
    r, _ = rpc(batch("s0-r001-n5-t100", keys[0:2], 5))
    check(len(r.remote_indexes) == 2 and min(r.remote_indexes) >= 0, f"first batch: {r}")
    got = list(r.remote_indexes)
    r, _ = rpc(batch("s0-r001-n5-t100", keys[2:4], 5))
    check(len(r.remote_indexes) == 2 and min(r.remote_indexes) >= 0, f"middle batch: {r}")
    got += r.remote_indexes
    r, _ = rpc(batch("s0-r001-n5-t100", keys[4:5], 5, last=True, toks=100))
    check(len(r.remote_indexes) == 1 and r.remote_indexes[0] >= 0, f"last batch: {r}")
    got += r.remote_indexes
    check(len(set(got)) == 5, f"five distinct slots: {got}")
    check(r.already_sent_indexes == [], "no dedup")

    # Oversized: total_chunks larger than the whole buffer fails at once, LMCache-shaped.
    r, raw = rpc(batch("s0-r003-n12-t256", keys[0:2], 1000))
    check(r.remote_indexes == [-1, -1], f"oversized: {r}")
    golden = bytes.fromhex(open(f"{golden_dir}/alloc_response_minus1.hex").read().strip())
    check(raw == golden, f"refusal bytes are LMCache's exactly: {raw.hex()} vs {golden.hex()}")

    # Legacy total_chunks = 0 is refused.
    r, _ = rpc(batch("s0-r009", keys[0:1], 0))
    check(r.remote_indexes == [-1], f"zero total_chunks: {r}")

    # R2: a first batch, then a cancel: the ack is LMCache's empty AllocResponse, byte for byte.
    r, _ = rpc(batch("s0-r002-n4-t256", keys[0:2], 4))
    check(len(r.remote_indexes) == 2, f"R2 first batch: {r}")
    r, raw = rpc(CancelNotif(req_id="s0-r002-n4-t256", keys=keys[0:2]))
    check(r.remote_indexes == [], f"cancel ack: {r}")
    golden = bytes.fromhex(open(f"{golden_dir}/alloc_response_cancel_ack.hex").read().strip())
    check(raw == golden, f"cancel ack bytes are LMCache's exactly: {raw.hex()} vs {golden.hex()}")
    # A late batch of the cancelled request is refused, never admitted afresh.
    r, _ = rpc(batch("s0-r002-n4-t256", keys[2:4], 4, last=True))
    check(r.remote_indexes == [-1, -1], f"late batch after cancel: {r}")

    sock.close()
    ctx.term()
    for f in failures:
        print("FAIL:", f)
    print(f"lmcache_sender: {13 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
