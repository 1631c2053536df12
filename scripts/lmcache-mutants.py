#!/usr/bin/env python3
"""Deliberately broken variants of kvx.lmcache (the LMCache backend), each of which
python/tests/test_lmcache.py must catch.

Copies python/ to a scratch folder, with the native module (kvx._kvx) of the kvx installed in
the test environment beside it, applies one mutation at a time to the copy, and runs the
LMCache tests against it (the copy comes first on PYTHONPATH). Needs the test environment of
scripts/python-tests.sh (target/pyenv with the kvx wheel, lmcache==0.5.6 and torch).
Usage: python3 scripts/lmcache-mutants.py [NAME ... | --check | --changed] (default: all;
scripts/mutant_selection.py). Exit status 1 if any
is missed.
"""
import os

import python_mutants

ROOT = python_mutants.ROOT
SCRATCH = "/tmp/kvx-lmcache-mutants"
PKG = "python/kvx/lmcache/"

# name: (file, old, new, what it breaks)
MUTANTS = {
    "worker-waits-for-admission": (PKG + "sender.py",
        'timeout=self.settings.extra["kvx_admission_grace_sec"])',
        "timeout=self.settings.allocation_timeout_sec)",
        "a store waits for its request's admission on the worker thread (the interleaved deadlock, moved into the worker)"),
    "waiting-chunk-not-copied": (PKG + "sender.py",
        "self.staging[start : start + size].copy_(obj.raw_data[:size])",
        "pass",
        "send a chunk that waited for admission without copying it into its staging slot"),
    "lease-never-consumed": (PKG + "memory.py",
        "done = self._left == 0",
        "done = False",
        "keep a retrieved request's slots for ever"),
    "engine-id-cancel-ignored": (PKG + "sender.py",
        "kvx_id = req_id if req_id in self._requests else self._by_engine_id.get(req_id)",
        "kvx_id = req_id if req_id in self._requests else None",
        "cancel_request with the engine's own id (vLLM's) reaches nothing (LMCache W5)"),
    "consume-deferred": (PKG + "receiver.py",
        'lease.consume(wait=False)\n        except kvx.KvxError as e:\n            logger.warning("kvx: consuming',
        'threading.Timer(0.05, lease.consume).start()\n        except kvx.KvxError as e:\n            logger.warning("kvx: consuming',
        "hand a retrieved request's slots back later than LMCache's last remove (admission waits on them)"),
    "last-chunk-full-size": (PKG + "memory.py",
        "shapes = metadata.get_shapes(tokens) if tokens is not None else metadata.get_shapes()",
        "shapes = metadata.get_shapes()",
        "view every received chunk as a full chunk, whatever its token count"),
}



def main():
    python = os.environ.get("KVX_PYTHON", os.path.join(ROOT, "target/pyenv/bin/python"))
    tests = lambda scratch: ["-x", os.path.join(scratch, "python/tests/test_lmcache.py"),
                             "-k", "not lmcaches_own"]
    python_mutants.main(MUTANTS, python, SCRATCH, tests, "scripts/lmcache-mutants.py")


if __name__ == "__main__":
    main()
