#!/usr/bin/env python3
"""Deliberately broken variants of kvx.vllm (the vLLM connector), each of which
python/tests/kvx_vllm/test_scheduler.py and test_pair.py (vLLM's real scheduler),
test_worker.py, test_router.py, test_router_guard.py, test_two_processes.py (two engine processes over kvx),
test_reasons.py and test_failure_reasons.py (a failed transfer's reason, through the router to its client),
test_prefill_transfer.py (the prefill transfer over a scripted sender),
test_host_buffer.py (KV through a host buffer, the GPU engines' path, on CPU tensors),
test_swarm.py (the lifecycle under seeded interleavings and faults) and test_explore.py (the
same, every interleaving of small worlds) must catch.

Copies python/ to a scratch folder, with the native module (kvx._kvx) of the kvx installed in
the test environment beside it, applies one mutation at a time to the copy, and runs the
scheduler tests against it (the copy comes first on PYTHONPATH). Needs the environment of
scripts/vllm-tests.sh (KVX_VLLM_VENV, default target/vllm-venv: vllm==0.33.0 and the kvx
wheel). Usage: python3 scripts/vllm-mutants.py [NAME ... | --check | --changed] (default:
all; scripts/mutant_selection.py). Exit status 1 if
any is missed.
"""
import os

import python_mutants

ROOT = python_mutants.ROOT
SCRATCH = "/tmp/kvx-vllm-mutants"
PKG = "python/kvx/vllm/"
# The router's tests first: they take seconds, and its variants are caught there.
TESTS = ["python/tests/kvx_vllm/test_host_buffer.py", "python/tests/kvx_vllm/test_router_guard.py", "python/tests/kvx_vllm/test_scheduler.py", "python/tests/kvx_vllm/test_pair.py",
         "python/tests/kvx_vllm/test_worker.py", "python/tests/kvx_vllm/test_router.py",
         "python/tests/kvx_vllm/test_reasons.py", "python/tests/kvx_vllm/test_failure_reasons.py",
         "python/tests/kvx_vllm/test_two_processes.py", "python/tests/kvx_vllm/test_swarm.py",
         "python/tests/kvx_vllm/test_prefill_transfer.py", "python/tests/kvx_vllm/test_explore.py"]

# name: (file, old, new, what it breaks)
MUTANTS = {
    "router-dead-engine-kept": (PKG + "router_pool.py",
        "            slot.down_since = time.monotonic()\n",
        "            pass\n",
        "an engine whose connection failed keeps getting new requests, each failing in turn"),
    "router-down-for-ever": (PKG + "router.py",
        "                        pool.mark_up(slot)\n",
        "                        pass\n",
        "an engine marked down never takes requests again, though its /health answers"),
    "router-silent-engine-kept": (PKG + "router.py",
        "                elif slot.down_since is None and pool.silent_for(slot) >= self.config.engine_liveness_sec:\n",
        "                elif False:\n",
        "an engine that stops answering (stopped, hung) keeps its requests in flight and gets new ones: they wait out request_timeout_sec"),
    "router-silent-requests-not-ended": (PKG + "router.py",
        "        for abort in list(slot.aborts):\n            abort(why)\n",
        "",
        "a silent engine is marked down, but its requests in flight wait on it"),
    "router-prefill-not-retried": (PKG + "router.py",
        "                errors.append(f\"{url}: {e!r}\")\n                continue\n",
        "                errors.append(f\"{url}: {e!r}\")\n                return None\n",
        "a prefill engine that cannot be connected to costs the request, though another is up"),
    "router-stream-cut-bare": (PKG + "router.py",
        "                if not streamed:\n                    raise\n",
        "                raise\n",
        "a decode engine that dies mid-stream cuts the client's stream without an error event or [DONE]"),
    "host-copy-not-awaited": (PKG + "host_buffer.py",
        "            elif not w.copy.ready():\n                return\n",
        "",
        "a layer's writes go before its device-to-host copy completed: they carry the host blocks' old bytes"),
    "decode-device-copy-skipped": (PKG + "host_buffer.py",
        "                self.copier.to_device(host, self.device[name], self._block_dim, blocks)\n",
        "                pass\n",
        "a received request's blocks stay in the host buffer: the decode engine reads its own old KV"),
    "host-buffer-blocks-on-first-dim": (PKG + "host_buffer.py",
        "self._block_dim = 0 if layout.pages_per_block == 1 else 1",
        "self._block_dim = 0",
        "K and V apart ([2, num_blocks, ...]): the copies take K or V of other blocks"),
    "router-header-deadline-never": (PKG + "router_guard.py",
        "if c.waiting_since is not None and now - c.waiting_since > self.header_timeout_sec",
        "if c.waiting_since is not None and now - c.waiting_since > self.header_timeout_sec and False",
        "the router never closes a connection that trickles its headers"),
    "router-no-room-for-newcomers": (PKG + "router_guard.py",
        "waiting = [c for c in self._conns.values() if c.waiting_since is not None]",
        "waiting = []",
        "at a connection cap the router refuses every newcomer: trickling connections lock clients out"),
    "router-containers-unbounded": (PKG + "router_guard.py",
        "if containers > MAX_JSON_CONTAINERS:",
        "if False:",
        "the router parses a body of any number of JSON objects and arrays"),
    "received-at-reserve": (PKG + "worker.py",
        "for kvx_id in events.received:",
        "for kvx_id in set(events.received) | set(self._reserved):",
        "report a decode request's KV received as soon as its blocks are reserved (finished too early)"),
    "abort-keeps-reservation": (PKG + "scheduler.py",
        "self._plan.release.append(Release(rid, reserve.kvx_id, reserved=True))",
        "pass",
        "an aborted decode request's reservation is never withdrawn (its blocks leak)"),
    "load-error-unreported": (PKG + "worker.py",
        "self._load_errors.update(r.block_ids)",
        "pass",
        "a failed load is reported received, its blocks never as load errors (silently wrong KV)"),
    "prefill-runs-before-grant": (PKG + "scheduler.py",
        "        return None, False",
        "        return 0, False",
        "a prefill request runs before its decode engine granted the blocks it writes into"),
    "grant-from-one-rank": (PKG + "scheduler.py",
        "if self.grant_counts[rid] >= self.tp_size:",
        "if self.grant_counts[rid] >= 1:",
        "one TP rank's grant lets the prefill run while another rank's sender has none"),
    "blocks-freed-before-delivery": (PKG + "scheduler.py",
        "        self.sending.add(rid)\n        return True,",
        "        return False,",
        "a finished prefill request's blocks are freed while its writes may still read them"),
    "reserve-blocks-misordered": (PKG + "scheduler.py",
        "tuple(block_ids[first:last])",
        "tuple(reversed(block_ids[first:last]))",
        "the reservation names the request's blocks in another order (KV lands in the wrong blocks)"),
    "push-source-shifted": (PKG + "scheduler.py",
        "tuple(st.blocks[st.next_block:upto])",
        "tuple(st.blocks[max(st.next_block - 1, 0):max(upto - 1, 1)])",
        "a push names the prefill engine's blocks one off (the wrong KV is sent)"),
    "partial-block-not-pushed": (PKG + "scheduler.py",
        "math.ceil(st.prompt_len / bs) if last",
        "st.prompt_len // bs if last",
        "the prompt's partial last block is never pushed"),
    "router-prefill-full-length": (PKG + "router.py",
        '    out["max_tokens"] = 1\n',
        "",
        "the router sends the prefill engine the client's whole generation, not one token"),
    "router-ids-differ": (PKG + "router.py",
        "self._prefill(path, prefill_body(body, path, kvx_id, claim_secret, decode.engine), kvx_id)",
        "self._prefill(path, prefill_body(body, path, new_kvx_id(), claim_secret, decode.engine), kvx_id)",
        "the two engines get different kvx ids for one request (the push reaches no reservation)"),
    "router-secrets-differ": (PKG + "router.py",
        "self._prefill(path, prefill_body(body, path, kvx_id, claim_secret, decode.engine), kvx_id)",
        "self._prefill(path, prefill_body(body, path, kvx_id, params.new_claim_secret(), decode.engine), kvx_id)",
        "the prefill engine gets another claim secret than the decode engine reserved with (its claim is refused)"),
    "decode-reserves-without-the-secret": (PKG + "kvx_transfer.py",
        "                    claim_secret=claim_secret, held=held,",
        "                    claim_secret=kvx.new_claim_secret(), held=held,",
        "the decode engine reserves with a secret of its own, not the router's: no prefill engine can claim"),
    "router-client-gone-keeps-prefill": (PKG + "router.py",
        '            self.stats["client_gone"] += 1\n            prefill_task.cancel()\n',
        '            self.stats["client_gone"] += 1\n',
        "a client that goes away leaves its prefill request running (its blocks held, its push into a withdrawn reservation)"),
    "transfer-prefix-hit-ignored": (PKG + "kvx_transfer.py",
        "held = first_block * layout.pages_per_block",
        "held = 0",
        "the decode engine's prefix hit is not declared held: the prefill engine's every block is one more than the reservation has room for"),
    "transfer-layers-share-slots": (PKG + "pages.py",
        "base = layer * self.pages_per_layer",
        "base = 0",
        "every layer's pages are numbered as layer 0's (the layers' KV would land in one layer)"),
    "transfer-failed-layer-consumed": (PKG + "kvx_transfer.py",
        "if not back.consumed and load.failure is None:",
        "if False:",
        "a layer whose load failed (a checksum, a lost prefill engine) is counted as received"),
    "transfer-sends-wrong-block": (PKG + "kvx_transfer.py",
        "slots = layout.block_pages(layer, block_ids)",
        "slots = layout.block_pages(layer, list(range(first_block, first_block + len(block_ids))))",
        "the prefill engine sends the block at the prompt's index instead of its own block id"),
    "transfer-sent-while-writes-read": (PKG + "kvx_transfer.py",
        "if push.open or push.draining:",
        "if push.open:",
        "a failed push is reported sent (vLLM frees its blocks) while its posted writes still read them"),
    "granted-abort-not-cancelled": (PKG + "scheduler.py",
        "            # engine's grant until cancelled, and a push that ends later must not be\n"
        "            # reported for a request vLLM has freed.\n"
        "            self._plan.cancel.append(rid)\n",
        "",
        "a prefill request aborted after its grant, before it ran, keeps its claim: the push's end is later reported for a request vLLM freed"),
    "router-transfer-reason-dropped": (PKG + "router.py",
        "    return reason if isinstance(reason, str) and reason else None\n",
        "    return None\n",
        "the router ignores why the prefill engine's push never began: its client waits for the decode engine's claim timeout, then gets no reason"),
    "router-decode-error-bare": (PKG + "router.py",
        "            if opened.error is not None:\n",
        "            if False:\n",
        "the router relays the decode engine's bare \"Internal server error\" for a failed load, without the reason or the kvx id"),
    "transfer-no-refused-probe": (PKG + "kvx_transfer.py",
        "refused = connection_refused(alloc, min(timeout, self.PROBE_TIMEOUT_SEC))",
        "refused = None",
        "a closed alloc port is found only by kvx's connect timeout, and reported as a timeout"),
    "prefill-answer-without-reason": (PKG + "scheduler.py",
        "            return False, {\"kvx_request_id\": kvx_id, ERROR: reason}\n",
        "            return False, None\n",
        "a prefill request whose claim failed answers without saying why"),
    "reasons-in-chunk-bytes": (PKG + "reasons.py",
        "    sizes = _SIZES.search(reason)\n",
        "    sizes = None\n",
        "unequal page sizes are logged in kvx's chunk and slot bytes, not as the engines' --block-size"),
    "decode-withdrawn-failure-unlogged": (PKG + "kvx_transfer.py",
        "elif not back.consumed and load.withdrawn and not _withdrawal(back.reason):",
        "elif False:",
        "a decode load that failed before its request was withdrawn is never logged with its reason"),
    "refused-push-end-kept": (PKG + "worker.py",
        "        self._sent_early.discard(rid)\n",
        "",
        "the end of a push refused before any write is kept for ever (a leak per refused request)"),
}



def main():
    venv = os.environ.get("KVX_VLLM_VENV", os.path.join(ROOT, "target/vllm-venv"))
    python = os.path.join(venv, "bin/python")
    # -x: a mutant is caught by its first failing test; the swarm alone takes ~30 s.
    tests = lambda scratch: ["-x", *(os.path.join(scratch, t) for t in TESTS)]
    python_mutants.main(MUTANTS, python, SCRATCH, tests, "scripts/vllm-mutants.py")


if __name__ == "__main__":
    main()
