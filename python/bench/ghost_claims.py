"""How long a real claim waits for admission while claims for ids nobody reserved (ghosts)
flood a caller-placement receiver (docs/spec/protocol.md §Caller placement, claim budgets).

40 raw ZeroMQ DEALERs (40 identities of one host, so one principal; pyzmq + msgspec, as an
attacker or LMCache's own sender speaks) send 9,000 first batches for ids nobody reserved,
each with a random claim secret, without waiting for answers; then, one after another, the
decode side reserves a real request and its own `kvx.Sender` (another identity of the same
host: the hardest case, its principal's waiting-claim budget is spent) claims it with the
right secret. Prints how long each real claim took from `begin` to admitted, against the
same claims with no ghosts, measured in the same run (needs pyzmq and msgspec).

    python python/bench/ghost_claims.py [--real N]
"""

import argparse
import statistics
import time

import kvx
import msgspec
import zmq

SLOT = 4096


def claim_latencies(rx: kvx.Receiver, tx: kvx.Sender, peer: int, n: int, tag: str) -> list:
    """Reserves and claims ``n`` one-chunk requests; each claim's seconds to admission."""
    took = []
    for i in range(n):
        req = f"real-{tag}-{i}"
        secret = kvx.new_claim_secret()
        rx.reserve(req, [i % rx.slots], claim_secret=secret)
        start = time.perf_counter()
        tx.begin(req, receiver=peer, total_chunks=1, claim_secret=secret)
        assert tx.wait_admitted(req, timeout=10.0), req
        took.append(time.perf_counter() - start)
        tx.cancel(req)
        rx.withdraw(req)
        rx.returned(timeout=10.0)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", type=int, default=20, help="real claims measured (default 20)")
    ap.add_argument("--ghosts", type=int, default=9000, help="ghost claims sent (default 9000)")
    ap.add_argument("--identities", type=int, default=40, help="ghost senders (default 40)")
    args = ap.parse_args()

    rx = kvx.Receiver(slots=64, slot_bytes=SLOT, placement="caller")
    tx = kvx.Sender(slots=2, slot_bytes=SLOT)
    peer = tx.add_receiver(rx.alloc_endpoint, rx.fabric_endpoint)
    quiet = claim_latencies(rx, tx, peer, args.real, "quiet")

    ctx = zmq.Context()
    ghosts = []
    per = -(-args.ghosts // args.identities)
    for g in range(args.identities):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"ghost-{g}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(rx.alloc_endpoint)
        for i in range(per):
            probe = {"type": "AllocRequest", "keys": [], "fmt": 1, "shape": [1], "dtype": "bfloat16",
                     "last_chunk_toks": 0, "req_id": f"ghost-{g}-{i}", "is_last_batch": False,
                     "total_chunks": 1, "seq": i, "claim": kvx.new_claim_secret()}
            sock.send_multipart([b"", msgspec.msgpack.encode(probe)])
        ghosts.append(sock)
    # Every ghost answered (refused past its budget) or waiting: the flood is in.
    deadline = time.monotonic() + 30
    answered = 0
    poller = zmq.Poller()
    for sock in ghosts:
        poller.register(sock, zmq.POLLIN)
    while time.monotonic() < deadline and answered < per * args.identities - 64:
        for sock, _ in poller.poll(200):
            while sock.poll(0):
                sock.recv_multipart()
                answered += 1
    snap = rx.snapshot()
    flooded = claim_latencies(rx, tx, peer, args.real, "flooded")

    ms = lambda xs: f"p50 {1e3 * statistics.median(xs):.2f} ms, max {1e3 * max(xs):.2f} ms"  # noqa: E731
    print(f"ghost claims sent: {per * args.identities} from {args.identities} identities; "
          f"refused at once: {answered}; waiting at the receiver: {snap['tracked_requests']}")
    print(f"real claim to admission, no ghosts:   {ms(quiet)}")
    print(f"real claim to admission, with ghosts: {ms(flooded)} "
          f"({statistics.median(flooded) / statistics.median(quiet):.2f}x the quiet p50)")
    for sock in ghosts:
        sock.close()
    ctx.term()


if __name__ == "__main__":
    main()
