"""A Python sender (kvx.Sender) talking to a `kvx receiver` process over ZeroMQ and the TCP
or shm fabric on loopback: the receiver checks every byte against kvx's synthetic workload, so a
request delivered from Python is one the Rust decoder read byte for byte. One chunk with a
flipped byte shows the check can fail: the receiver counts it corrupt and exits 1."""

import os
import re
import signal
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


def start_receiver(fabric_name: str, stderr) -> "tuple[subprocess.Popen, str, str]":
    """Starts a `kvx receiver` on ports the kernel picks (0) and reads the endpoints it bound
    from its first stderr line: no port is chosen here that another socket could take in the
    meantime. Bounded: 30 s, or at once when the process exits."""
    proc = subprocess.Popen(
        [kvx_binary(), "receiver", "--alloc-ports", "0", "--fabric-ports", "0",
         "--fabric", fabric_name,
         "--buffer-chunks", "16", "--chunk-bytes", str(SLOT), "--peer-share-percent", "100",
         "--exit-after-s", "120"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"rank 0: alloc (\S+) fabric (\S+)", Path(stderr.name).read_text())
        if m:
            return proc, m.group(1), m.group(2)
        time.sleep(0.05)
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    pytest.fail(f"the kvx receiver did not report its endpoints (exit {proc.returncode}): "
                f"{out}{Path(stderr.name).read_text()}")


@pytest.mark.parametrize("fabric_name", ["tcp", "shm"])
def test_a_python_sender_delivers_to_a_kvx_receiver_process_byte_exact(fabric_name, tmp_path):
    # shm: the slot views are views of the staging mapping the receiver process maps too.
    with open(tmp_path / "receiver.err", "w+") as stderr:
        proc, alloc, fabric = start_receiver(fabric_name, stderr)
        try:
            run_requests(proc, stderr, fabric_name, alloc, fabric)
        finally:
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=30)
        err = Path(stderr.name).read_text()
    m = re.search(r"(\d+) bytes verified, (\d+) corrupt chunks", out)
    assert m, out + err
    good = sum(c for r, c in REQUESTS.items() if r != "py-bad")
    assert int(m.group(1)) == good * SLOT, out
    assert int(m.group(2)) == 1, "the flipped byte was caught: " + out
    assert proc.returncode == 1, "a corrupt chunk fails the receiver's exit status"


REQUESTS = {"py-0": 6, "py-1": 3, "py-2": 5, "py-bad": 2}


def run_requests(proc: subprocess.Popen, stderr, fabric_name: str, alloc: str, fabric: str) -> None:
    tx = kvx.Sender(slots=4, slot_bytes=SLOT, fabric=fabric_name)
    peer, error = None, None
    for _ in range(10):  # the endpoints are bound: the first try connects unless the host stalls
        try:
            peer = tx.add_receiver(alloc, fabric, timeout=5.0)
            break
        except kvx.KvxError as e:
            error = e
            assert proc.poll() is None, f"the receiver exited: {Path(stderr.name).read_text()}"
    assert peer is not None, f"connected to the kvx receiver: {error!r}; {Path(stderr.name).read_text()}"
    for req_id, chunks in REQUESTS.items():
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
