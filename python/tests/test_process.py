"""A Python sender (kvx.Sender) talking to a `kvx receiver` process over ZeroMQ and the TCP
fabric on loopback: the receiver checks every byte against kvx's synthetic workload, so a
request delivered from Python is one the Rust decoder read byte for byte. One chunk with a
flipped byte shows the check can fail: the receiver counts it corrupt and exits 1."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import kvx

np = pytest.importorskip("numpy")
from synthetic import chunk_bytes  # noqa: E402

SLOT = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


def kvx_binary() -> str:
    path = os.environ.get("KVX_BIN") or str(ROOT / "target" / "release" / "kvx")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no kvx binary at {path} (cargo build --release -p kvx, or set KVX_BIN)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fabric_name", ["tcp", "shm"])
def test_a_python_sender_delivers_to_a_kvx_receiver_process_byte_exact(fabric_name):
    # shm: the slot views are views of the staging mapping the receiver process maps too.
    alloc, fabric = free_port(), free_port()
    proc = subprocess.Popen(
        [kvx_binary(), "receiver", "--alloc-ports", str(alloc), "--fabric-ports", str(fabric),
         "--fabric", fabric_name,
         "--buffer-chunks", "16", "--chunk-bytes", str(SLOT), "--peer-share-percent", "100",
         "--exit-after-s", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tx = kvx.Sender(slots=4, slot_bytes=SLOT, fabric=fabric_name)
        peer = None
        for _ in range(100):  # the process binds its ports within a few seconds
            try:
                peer = tx.add_receiver(f"tcp://127.0.0.1:{alloc}", f"127.0.0.1:{fabric}", timeout=1.0)
                break
            except kvx.KvxError:
                time.sleep(0.1)
        assert peer is not None, "connected to the kvx receiver"
        requests = {"py-0": 6, "py-1": 3, "py-2": 5, "py-bad": 2}
        for req_id, chunks in requests.items():
            tx.begin(req_id, receiver=peer, total_chunks=chunks)
            assert tx.wait_admitted(req_id, timeout=10.0)
            for c in range(chunks):
                slot = tx.allocate(req_id, timeout=10.0)
                view = np.frombuffer(slot.view, dtype=np.uint8)
                view[:] = chunk_bytes(req_id, c, SLOT)
                if req_id == "py-bad" and c == 1:
                    view[SLOT // 2] ^= 0x10  # the check must see this
                tx.add(slot, f"{req_id}@{c}", tokens=256)
            tx.submit(req_id, last=True)
            tx.wait_outcome(req_id, timeout=10.0)
        time.sleep(0.5)  # the receiver's decoder reads the last request
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    m = re.search(r"(\d+) bytes verified, (\d+) corrupt chunks", out)
    assert m, out + err
    good = sum(c for r, c in requests.items() if r != "py-bad")
    assert int(m.group(1)) == good * SLOT, out
    assert int(m.group(2)) == 1, "the flipped byte was caught: " + out
    assert proc.returncode == 1, "a corrupt chunk fails the receiver's exit status"
