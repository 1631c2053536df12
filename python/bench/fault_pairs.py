"""The fault matrix's kill rows with two pairs of engines under llm-d's routing sidecar
(``docs/reliability.md``, "Two pairs under llm-d's sidecar"): two prefill and two decode vLLM
engines (the CPU build) with kvx's connector, configured for llm-d (``docs/vllm.md``, "Under
llm-d"), on loopback, and a client that sends what llm-d's sidecar sends
(``python/tests/kvx_vllm_e2e/llmd_sidecar.py``: the bootstrap ``/query``, a ``transfer_id``,
both legs at once), one sidecar per decode engine as in llm-d's decode pods. Each prefill
engine has an address of its own (127.0.0.2, 127.0.0.3) and its bootstrap server the same
port on it, as each prefill pod does; request j goes to decode engine j mod 2 and prefill
engine (j div 2) mod 2, so that each decode engine is fed by both prefill engines.

For each fault (``prefill-killed``, ``decode-killed``: SIGKILL to the process group of
prefill engine 0 or decode engine 0) at each state (``computing``, ``mid-push``, ``pushed``,
as ``fault_matrix.py`` holds them: prefill engine 0's ``slow_connector.py`` marks), a cell:

1. ``--in-flight`` requests (default 8, two through each prefill–decode pair) go at once;
   the fault comes when prefill engine 0 reaches the state.
2. **faulted**: the requests with a leg on the killed engine; their outcome (classified as
   ``fault_matrix.py`` does: ``correct``, a typed failure, ``UNTYPED``, ``WRONG TOKENS``,
   ``HANG`` past ``--hang-bound``) and the time from the fault to the last one's end.
   A killed prefill engine's requests are recomputed by their decode engines
   (``kv_load_failure_policy: recompute``; a reservation whose registration never reached it
   fails its load at once). A killed decode engine cannot answer: llm-d's sidecar proxies its
   decode engine's answer, and Go's reverse proxy answers a request whose upstream
   connection broke before any response with a bare ``502`` (llm-d-router's
   ``pkg/sidecar/proxy``: the decode leg through ``httputil.ReverseProxy``; read, not
   copied); this client answers so, as ``502 sidecar``. Requests are not streamed: vLLM
   answers one only once it is complete, so nothing of a killed engine's answer has gone.
3. **others in flight**: the requests of the same batch with neither leg on the killed engine.
4. **survivors idle**: from the fault until the three other engines hold no KV block and run
   no request. **others while down**: then, while the killed engine starts again on its
   ports, requests through the pairs without it, one through each at a time (at most
   ``OTHERS_MAX``), as llm-d's endpoint picker sends once the dead pod is out of its pool.
5. **next**: once the engine is back (started again on its ports), one request through each
   of the four pairs at once; and the time from its ``/health`` answering to the first
   correct answer through it.

Every request's answer must be the single engine's (``fault_matrix.reference_answers``). Each
row also counts what kvx counted failed on each engine over the cell (``vllm:kvx_*_failed_total``,
``vllm:kvx_claims_refused_total``): which transfers the fault cost, and whether any other did.
CPUs (``--pin``, the default): the prefill engines on the first half of this process's CPUs,
the decode engines on the second, as ``vllm_connectors.py`` pins them.
Prints a Markdown table, writes JSON (``--out``); exit 1 when any request hung, was cut
without an answer, or answered wrong tokens, or a state was not reached. As root or not: no
network namespaces (a kill needs none)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple, cast

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fault_matrix as fm  # noqa: E402  (puts the e2e folder on sys.path)
import tiny_llama  # noqa: E402
from cluster import START_TIMEOUT, Process, engine, free_port  # noqa: E402
from llmd_sidecar import Sidecar  # noqa: E402
from vllm_connectors import scrape, split_cpus  # noqa: E402

FAULTS = ["prefill-killed", "decode-killed"]
#: The states held by prefill engine 0's marks alone (the decode engines hold nothing).
STATES = ["computing", "mid-push", "pushed"]
#: Each prefill engine's address: a pod of its own, its bootstrap server on the same port.
PREFILL_HOSTS = ["127.0.0.2", "127.0.0.3"]
#: The most requests through the other pairs while the killed engine is down, per cell.
OTHERS_MAX = 40
NEXT = 4


class Engines:
    """Two prefill and two decode engines for llm-d, on ports kept across restarts."""

    def __init__(self, model: str, logdir: str, policy: str, pin: bool = True) -> None:
        self.model, self.logdir, self.policy = model, logdir, policy
        #: The prefill engines' CPUs and the decode engines' (``taskset -c`` lists), or None.
        self.cpus = split_cpus() if pin else (None, None)
        self.bootstrap = free_port()
        #: Each engine's name → its HTTP port, and the decode engines' kvx ports.
        self.ports = {name: free_port() for name in ("decode0", "decode1", "prefill0", "prefill1")}
        self.kvx_ports = {name: (free_port(), free_port()) for name in ("decode0", "decode1")}
        self.procs: Dict[str, Process] = {}
        self.starts = 0

    def mark(self, name: str) -> str:
        return os.path.join(self.logdir, f"marks-{name}")

    def _kv(self, name: str) -> Dict[str, Any]:
        base = {"kv_connector": "SlowKvxConnector", "kv_connector_module_path": "slow_connector"}
        if name.startswith("decode"):
            alloc, fabric = self.kvx_ports[name]
            return {**base, "kv_role": "kv_consumer", "kv_load_failure_policy": self.policy,
                    "kv_connector_extra_config": {"host": "127.0.0.1", "alloc_port": alloc, "fabric_port": fabric}}
        i = int(name[-1])
        return {**base, "kv_role": "kv_producer", "kv_connector_extra_config": {
            "bootstrap_port": self.bootstrap, "bootstrap_host": PREFILL_HOSTS[i],
            "bootstrap_engine_id": f"kvx-prefill{i}"}}

    def start(self, name: str) -> None:
        env = {"KVX_E2E_ROLE": "decode" if name.startswith("decode") else "prefill", "KVX_E2E_MARK": self.mark(name)}
        self.starts += 1
        cpus = self.cpus[0 if name.startswith("prefill") else 1]
        proc, _ = engine(f"{name}-{self.starts}", self.model, self.logdir, self._kv(name), env=env, cpus=cpus,
                         port=self.ports[name])
        self.procs[name] = proc

    def wait_up(self, name: str) -> None:
        self.procs[name].wait_http(f"http://127.0.0.1:{self.ports[name]}/health", START_TIMEOUT)

    def up(self) -> None:
        for name in self.ports:
            self.start(name)
        for name in self.ports:
            self.wait_up(name)

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].proc.pid, signal.SIGKILL)

    def restart(self, name: str) -> float:
        """Starts ``name`` again on its ports (killed before if alive); seconds until its
        ``/health`` answers."""
        began = time.monotonic()
        proc = self.procs[name]
        if proc.proc.poll() is None:
            os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(30)
        proc.log.close()
        self.start(name)
        self.wait_up(name)
        return time.monotonic() - began

    def down(self) -> None:
        for proc in self.procs.values():
            proc.stop()

    def idle(self, name: str) -> bool:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.ports[name]}/metrics", timeout=2).read().decode()
        except OSError:
            return False
        values = []
        for metric in ("kv_cache_usage_perc", "num_requests_running"):
            found = re.findall(r"^vllm:%s\{[^}]*\} ([0-9.e+-]+)$" % metric, text, re.M)
            values.append(sum(float(v) for v in found) if found else float("nan"))
        return values == [0.0, 0.0]

    def failures(self) -> Dict[str, float]:
        """Each engine's kvx failure counters now (``name:metric`` → count)."""
        out: Dict[str, float] = {}
        for name, port in self.ports.items():
            for key, value in scrape(port).items():
                if key.endswith("_failed_total") or key.startswith("vllm:kvx_claims_refused_total"):
                    out[f"{name}:{key[len('vllm:kvx_'):]}"] = value
        return out

    def until_idle(self, names: List[str], bound: float) -> Optional[float]:
        """Seconds until every engine of ``names`` is idle (None past ``bound``)."""
        began = time.monotonic()
        while time.monotonic() - began < bound:
            if all(self.idle(n) for n in names):
                return time.monotonic() - began
            time.sleep(0.25)
        return None


class Request:
    """One non-streamed completion through a decode engine's sidecar, in a thread of its own;
    the attributes ``fault_matrix.outcome`` reads."""

    def __init__(self, sidecar: Sidecar, prefill: str, model: str, index: int, route: Tuple[int, int]) -> None:
        self.index, self.route = index, route
        self.got = ""
        self.error: Optional[str] = None
        self.typed = True
        self.hung = False
        self.began = time.monotonic()
        self.ended: Optional[float] = None
        self._args = (sidecar, prefill, {"model": model, "prompt": fm.prompt(index), "max_tokens": fm.MAX_TOKENS,
                                         "temperature": 0})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sidecar, prefill, body = self._args
        try:
            status, raw = sidecar.post(body, prefill)
            if status == 200:
                self.got = json.loads(raw)["choices"][0]["text"]
            else:
                try:
                    error = json.loads(raw)["error"]
                    self.error = f"{status} {error.get('type')}: {str(error.get('message'))[:100]}"
                except (ValueError, KeyError, TypeError):
                    self.error = f"{status}: {raw[:100]!r}"
        except (OSError, http.client.HTTPException, RuntimeError) as e:
            # The decode engine's connection broke before its answer (or the prefill pod's
            # bootstrap server did not answer its /query): the sidecar answers 502.
            self.error = f"502 sidecar: {e!r}"[:160]
        except (ValueError, KeyError) as e:
            self.error, self.typed = f"client: {e!r}"[:160], False
        finally:
            self.ended = time.monotonic()

    def join(self, until: float) -> None:
        self.thread.join(max(0.0, until - time.monotonic()))
        if self.ended is None:
            self.hung = True


class Client:
    """The sidecars (one per decode engine) and where request j goes."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.sidecars = [Sidecar(f"127.0.0.1:{engines.ports[f'decode{d}']}", engines.bootstrap) for d in range(2)]

    @staticmethod
    def route(j: int) -> Tuple[int, int]:
        """(prefill, decode) of the ``j``th request of a batch: every pair in turn."""
        return (j // 2) % 2, j % 2

    def send(self, index: int, route: Tuple[int, int]) -> Request:
        p, d = route
        prefill = f"{PREFILL_HOSTS[p]}:{self.engines.ports[f'prefill{p}']}"
        return Request(self.sidecars[d], prefill, self.engines.model, index, route)


def touches(route: Tuple[int, int], fault: str) -> bool:
    """Whether a request on ``route`` has a leg on the engine ``fault`` kills (engine 0)."""
    return route[0 if fault.startswith("prefill") else 1] == 0


def verdict(request: Request, references: List[str]) -> str:
    """``fault_matrix.outcome`` of ``request`` (which has the attributes it reads)."""
    return fm.outcome(cast(Any, request), references[request.index], "")


def verdicts(requests: List[Request], references: List[str]) -> List[str]:
    return [verdict(r, references) for r in requests]


def span(requests: List[Request], since: float) -> Optional[float]:
    ends = [r.ended for r in requests]
    return None if not ends or None in ends else round(max(e for e in ends if e is not None) - since, 2)


def cell(engines: Engines, client: Client, references: List[str], base: int, fault: str, state: str,
         in_flight: int, hang_bound: float) -> Dict[str, Any]:
    """One cell, with prompts ``base …`` (``per_cell(in_flight)`` of them)."""
    names = list(engines.ports)
    engines.until_idle(names, 60)
    for name in ("prefill0", "prefill1"):
        if os.path.exists(engines.mark(name)):
            os.remove(engines.mark(name))
    row: Dict[str, Any] = {"fault": fault, "state": state, "in_flight": in_flight}
    batch = [client.send(base + j, client.route(j)) for j in range(in_flight)]
    # fault_matrix.wait_state reads the attribute ``ended`` of each request.
    if not fm.wait_state(engines.mark("prefill0"), state, 120, cast(Any, batch)):
        for r in batch:
            r.join(time.monotonic() + hang_bound)
        row["outcome"] = f"state not reached (the requests: {fm.counted(verdicts(batch, references))})"
        return row
    killed = f"{fault.split('-')[0]}0"
    counters = engines.failures()
    faulted = time.monotonic()
    engines.kill(killed)
    mine = [r for r in batch if touches(r.route, fault)]
    others = [r for r in batch if not touches(r.route, fault)]
    for r in batch:
        r.join(faulted + hang_bound)
    row["outcome"] = fm.counted(verdicts(mine, references))
    row["client_s"] = span(mine, faulted)
    row["others_in_flight"] = fm.counted(verdicts(others, references))
    row["others_in_flight_s"] = span(others, faulted)
    row["requests"] = [{"route": r.route, "s": round(r.ended - faulted, 2) if r.ended else None,
                        "outcome": fm.short(verdict(r, references))} for r in batch]
    idle = engines.until_idle([n for n in names if n != killed], 60)
    row["survivors_idle_s"] = round(time.monotonic() - faulted, 2) if idle is not None else "busy 60 s after"
    # The other pairs while the engine starts again: one request through each at a time, in
    # a thread of its own (at most OTHERS_MAX), until it is back.
    survivors = [route for route in ((0, 0), (1, 0), (0, 1), (1, 1)) if not touches(route, fault)]
    back = threading.Event()
    while_down: List[Request] = []

    def keep_serving() -> None:
        index = base + in_flight
        while not back.is_set() and len(while_down) + len(survivors) <= OTHERS_MAX:
            wave = [client.send(index + k, route) for k, route in enumerate(survivors)]
            index += len(wave)
            for r in wave:
                r.join(time.monotonic() + hang_bound)
            while_down.extend(wave)

    serving = threading.Thread(target=keep_serving, daemon=True)
    serving.start()
    row["restart_s"] = round(engines.restart(killed), 1)
    came_back = time.monotonic()
    back.set()
    serving.join(2 * hang_bound)
    row["others_while_down"] = fm.counted(verdicts(while_down, references)) if while_down else "none sent"
    row["others_while_down_s"] = round(max(r.ended - r.began for r in while_down if r.ended), 2) if while_down else None
    first = base + in_flight + OTHERS_MAX
    nexts = [client.send(first + k, route) for k, route in enumerate(((0, 0), (1, 0), (0, 1), (1, 1)))]
    for r in nexts:
        r.join(time.monotonic() + hang_bound)
    row["next"] = fm.counted(verdicts(nexts, references))
    through = [r for r in nexts if touches(r.route, fault) and verdict(r, references) == "correct"]
    row["next_correct_s"] = round(min(r.ended for r in through if r.ended) - came_back, 2) if through else None
    # What kvx counted failed on each engine over the cell (the killed engine's from its
    # restart on): which transfers the fault cost, and whether any other did.
    after = engines.failures()
    row["kvx_failures"] = {k: v if k.startswith(killed + ":") else v - counters.get(k, 0.0) for k, v in after.items()
                           if (v if k.startswith(killed + ":") else v - counters.get(k, 0.0))}
    return row


def per_cell(in_flight: int) -> int:
    return in_flight + OTHERS_MAX + NEXT


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| fault | state | the killed engine's requests | client s | the others in flight | the others while "
           "it was down | survivors idle s | engine back in s | next, one per pair | first correct through it s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['fault']} | {r['state']} | {fm.short(str(r.get('outcome')))} | {r.get('client_s', '')} | "
                   f"{fm.short(str(r.get('others_in_flight', '')))} | {fm.short(str(r.get('others_while_down', '')))} | "
                   f"{r.get('survivors_idle_s', '')} | {r.get('restart_s', '')} | {fm.short(str(r.get('next', '')))} | "
                   f"{r.get('next_correct_s', '')} |")
    return "\n".join(out)


BAD = re.compile(r"HANG|WRONG|UNTYPED|not reached")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--states", default="mid-push", help=f"comma-separated, of {', '.join(STATES)} (default mid-push)")
    ap.add_argument("--in-flight", type=int, default=8, help="requests at once when the fault comes (default 8, "
                                                              "a multiple of 4 puts as many through each pair)")
    ap.add_argument("--policy", default="recompute", help="the decode engines' kv_load_failure_policy")
    ap.add_argument("--hang-bound", type=float, default=120.0, help="a request not ended after this is a HANG")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="the prefill engines on the first half of this process's CPUs, the decode engines on the "
                         "second (as python/bench/vllm_connectors.py pins them; default: on)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    states = [s for s in args.states.split(",") if s]
    for f in faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r} (known: {', '.join(FAULTS)})")
    for s in states:
        if s not in STATES:
            ap.error(f"unknown state {s!r} (known: {', '.join(STATES)})")
    if args.in_flight < 1:
        ap.error("--in-flight must be at least 1")
    logdir = tempfile.mkdtemp(prefix="kvx-fault-pairs-")
    model = tiny_llama.make(os.path.join(logdir, "model"))
    os.environ.setdefault("KVX_E2E_SLOW_SAVE_SEC", "1.5")
    cells = [(f, s) for f in faults for s in states]
    references = fm.reference_answers(model, logdir, per_cell(args.in_flight) * len(cells))
    rows: List[Dict[str, Any]] = []
    began = time.monotonic()
    engines = Engines(model, logdir, args.policy, args.pin)
    try:
        engines.up()
        client = Client(engines)
        for k, (fault, state) in enumerate(cells):
            row = cell(engines, client, references, k * per_cell(args.in_flight), fault, state, args.in_flight,
                       args.hang_bound)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        engines.down()
    bad = [r for r in rows if any(BAD.search(str(r.get(k))) for k in ("outcome", "others_in_flight",
                                                                          "others_while_down", "next"))]
    print(f"\n{len(rows)} cells in {time.monotonic() - began:.0f} s, {len(bad)} with a request hung, wrong, untyped "
          f"or a state not reached: two prefill and two decode kvx engines under llm-d's sidecar; "
          f"kv_load_failure_policy {args.policy}; {args.in_flight} requests in flight (logs: {logdir})\n")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
