"""The contrast of ``test_lmcache.py``: one request alone (which it delivers), two requests
interleaved on one thread and four concurrent requests per sender against LMCache's own
``PDBackendAsync`` (its ``mock_memory`` transfer channel), in a
process of their own. Prints one JSON line with what each delivered, what failed with a
notice, and how long it took; then exits without waiting for LMCache's close, which can
hang on its wedged sockets."""

import json
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
logging.disable(logging.CRITICAL)

from lmcache_cluster import (  # noqa: E402
    Cluster, Decoder, four_concurrent, interleave, run_interleaved_on_one_thread,
)

TIMEOUT = 2.0


def main() -> None:
    result = {}
    # The positive twin: one request alone, which LMCache's backend does deliver (notified
    # ready, every chunk found), so a contrast that loses requests shows LMCache's doing,
    # not a setup that moves nothing.
    cluster = Cluster(buffer_chunks=10, timeout=TIMEOUT)
    decoder = Decoder(cluster, {"solo": 4}, deadline_s=4 * TIMEOUT + 10)
    decoder.start()
    interleave(cluster, {"solo": 4}, 2)
    decoder.join(timeout=4 * TIMEOUT + 10)
    result["alone"] = {"present": decoder.present, "failed": decoder.failed}
    cluster, decoder, took, stuck = run_interleaved_on_one_thread(timeout=TIMEOUT)
    result["interleaved"] = {
        "backend": type(cluster.senders[0].allocator_backend).__name__,
        "delivered": decoder.delivered, "present": decoder.present, "failed": decoder.failed,
        "took": took, "stuck": stuck, "timeout": TIMEOUT,
    }
    # Not closed: LMCache's close terminates the process-wide ZeroMQ context its next
    # backend would need. The process exits instead.
    cluster = Cluster(buffer_chunks=12, staging_chunks=6, timeout=TIMEOUT)
    plans, decoder, stuck = four_concurrent(cluster, deadline_s=20.0)
    result["four"] = {"plans": plans, "delivered": decoder.delivered, "present": decoder.present,
                      "failed": decoder.failed, "stuck": stuck}
    print(json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    threading.Thread(target=lambda: (time.sleep(240), os._exit(3)), daemon=True).start()
    try:
        main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
