"""The fault matrix of ``docs/reliability.md``: real vLLM engines (the CPU build) with a KV
connector, each engine in a network namespace of its own, kvx's router and the client in the
host's. For each fault, at each state of a request, one streamed request meets the fault, and
the cell records the outcome and how long it took:

- **outcome** at the client (through the router): ``correct`` (the single engine's tokens),
  ``typed failure`` (an OpenAI error object or error event, with its type), ``WRONG TOKENS``,
  or ``HANG`` (no end within ``--hang-bound``);
- **client s**: from the fault to the request's end at the client;
- **decode idle s** / **prefill idle s**: from the fault until the engine holds no KV blocks
  and runs no request (its ``vllm:kv_cache_usage_perc`` and ``vllm:num_requests_running``
  at 0; ``-`` while it is stopped or dead);
- **next**: whether the next request after the fault (and after a killed or stopped engine
  was restarted, or a link came back) is answered correctly, and how long the engines took to
  be back.

Faults: an engine killed (SIGKILL to its process group) or hung (SIGSTOP), the prefill–decode
link down (``ip link set down`` on the veth) for 1 s or for 30 s, and the client going away.
States, from the prefill engine's connector (``slow_connector.py``: each layer's save takes
``KVX_E2E_SLOW_SAVE_SEC``): ``computing`` (the prefill engine's first layer is being
computed: the reservation is claimed, nothing written), ``mid-push`` (one layer's writes
posted, the next being computed), ``pushed`` (every layer's writes posted).

Run by ``scripts/fault-matrix.sh``, which makes the namespaces and veth pairs, and removes
them; as root. Prints a Markdown table and writes JSON (``--out``)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "tests", "kvx_vllm_e2e")
sys.path.insert(0, E2E)

import tiny_llama  # noqa: E402
from cluster import START_TIMEOUT, Process, engine  # noqa: E402

#: The topology ``scripts/fault-matrix.sh`` makes: each engine's namespace, its address on
#: the router's link, and its address on the prefill–decode link (kvx's traffic).
NETNS = {"prefill": "kvxfm-p", "decode": "kvxfm-d"}
HTTP_ADDR = {"prefill": "10.78.1.2", "decode": "10.78.2.2"}
PD_ADDR = {"prefill": "10.78.0.1", "decode": "10.78.0.2"}
#: The prefill engine's end of the prefill–decode veth pair.
PD_LINK = ("kvxfm-p", "kvxfm-pd0")
PORTS = {"prefill": 8100, "decode": 8200, "alloc": 8400, "fabric": 8300, "router": 8000}
MAX_TOKENS = 16
FAULTS = ["prefill-killed", "prefill-hung", "decode-killed", "decode-hung", "link-down-1s", "link-down-30s",
          "client-gone"]
STATES = ["computing", "mid-push", "pushed"]


def prompt(index: int) -> str:
    """The ``index``th prompt: three blocks of the tiny model's words (a block is 128 tokens
    on vLLM's CPU backend), each its own, so that no engine finds one in its prefix cache."""
    import numpy as np

    rng = np.random.default_rng(1000 + index)
    return " ".join(tiny_llama.WORDS[i] for i in rng.integers(0, len(tiny_llama.WORDS), 290))


def metrics(kind: str) -> Optional[Dict[str, float]]:
    try:
        text = urllib.request.urlopen(f"http://{HTTP_ADDR[kind]}:{PORTS[kind]}/metrics", timeout=1).read().decode()
    except OSError:
        return None
    out = {}
    for name in ("kv_cache_usage_perc", "num_requests_running"):
        found = re.findall(r"^vllm:%s\{[^}]*\} ([0-9.e+-]+)$" % name, text, re.M)
        out[name] = sum(float(v) for v in found) if found else float("nan")
    return out


def idle(kind: str) -> bool:
    m = metrics(kind)
    return m is not None and m["kv_cache_usage_perc"] == 0.0 and m["num_requests_running"] == 0.0


class Cluster:
    """The engines and the router; ``restart`` brings one engine back on its ports."""

    def __init__(self, model: str, logdir: str, connector: str, policy: str) -> None:
        self.model, self.logdir, self.connector, self.policy = model, logdir, connector, policy
        self.mark = os.path.join(logdir, "posted")
        self.procs: Dict[str, Process] = {}
        self.starts = 0

    def _kv(self, kind: str) -> Dict[str, Any]:
        if self.connector == "kvx":
            if kind == "decode":
                return {"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm",
                        "kv_role": "kv_consumer", "kv_load_failure_policy": self.policy,
                        "kv_connector_extra_config": {"host": PD_ADDR["decode"], "alloc_port": PORTS["alloc"],
                                                      "fabric_port": PORTS["fabric"]}}
            return {"kv_connector": "SlowKvxConnector", "kv_connector_module_path": "slow_connector",
                    "kv_role": "kv_producer", "kv_connector_extra_config": {}}
        raise SystemExit(f"connector {self.connector!r}: only kvx is wired here")

    def start(self, kind: str) -> None:
        env = {"KVX_E2E_MARK": self.mark} if kind == "prefill" else {}
        self.starts += 1
        proc, _ = engine(f"{kind}-{self.starts}", self.model, self.logdir, self._kv(kind), env=env,
                         netns=NETNS[kind], port=PORTS[kind])
        self.procs[kind] = proc

    def wait_up(self, kind: str) -> None:
        self.procs[kind].wait_http(f"http://{HTTP_ADDR[kind]}:{PORTS[kind]}/health", START_TIMEOUT)

    def up(self) -> None:
        for kind in ("decode", "prefill"):
            self.start(kind)
        for kind in ("decode", "prefill"):
            self.wait_up(kind)
        config = os.path.join(self.logdir, "router.json")
        with open(config, "w") as f:
            json.dump({"listen": f"127.0.0.1:{PORTS['router']}",
                       "prefill": [{"url": f"http://{HTTP_ADDR['prefill']}:{PORTS['prefill']}"}],
                       "decode": [{"url": f"http://{HTTP_ADDR['decode']}:{PORTS['decode']}",
                                   "kvx_alloc": [f"tcp://{PD_ADDR['decode']}:{PORTS['alloc']}"],
                                   "kvx_fabric": [f"tcp://{PD_ADDR['decode']}:{PORTS['fabric']}"]}]}, f)
        self.procs["router"] = Process("router", [sys.executable, "-m", "kvx.vllm.router", "--config", config],
                                       self.logdir)
        self.procs["router"].wait_http(f"http://127.0.0.1:{PORTS['router']}/health", 60)

    def signal(self, kind: str, sig: int) -> None:
        os.killpg(self.procs[kind].proc.pid, sig)

    def restart(self, kind: str) -> float:
        """Kills ``kind``'s engine (whatever its state) and starts it again on its ports;
        seconds until it answers its ``/health``."""
        began = time.monotonic()
        proc = self.procs[kind]
        if proc.proc.poll() is None:
            os.killpg(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait()
        proc.log.close()
        self.start(kind)
        self.wait_up(kind)
        return time.monotonic() - began

    def down(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.stop()


def link(up: bool) -> None:
    ns, dev = PD_LINK
    subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "up" if up else "down"], check=True)


class Streamed:
    """One streamed completion through the router, read in a thread of its own: its text,
    the error it ended with, and when it ended."""

    def __init__(self, model: str, text: str, hang_bound: float) -> None:
        self.model, self.text, self.hang_bound = model, text, hang_bound
        self.got, self.error, self.status = "", None, None  # type: ignore[var-annotated]
        self.ended: Optional[float] = None
        self.sock: Optional[socket.socket] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": self.text, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "stream": True}).encode()
        try:
            self.sock = socket.create_connection(("127.0.0.1", PORTS["router"]), timeout=self.hang_bound)
            self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\ncontent-type: application/json\r\n"
                              b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            raw = b""
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
            self._parse(raw)
        except OSError as e:
            self.error = self.error or f"connection: {e!r}"
        finally:
            self.ended = time.monotonic()

    def _parse(self, raw: bytes) -> None:
        head, _, body = raw.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else None
        if self.status != 200:
            try:
                error = json.loads(_dechunk(body))["error"]
                self.error = f"{self.status} {error.get('type')}: {str(error.get('message'))[:100]}"
            except (ValueError, KeyError, TypeError):
                self.error = f"{self.status}: {body[:100]!r}"
            return
        for line in _dechunk(body).split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                self.error = f"event {event['error'].get('type')}: {str(event['error'].get('message'))[:100]}"
            else:
                self.got += "".join(c.get("text", "") for c in event.get("choices", []))

    def abort(self) -> None:
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def _dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes (or ``body`` as it is)."""
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        try:
            n = int(size, 16)
        except ValueError:
            return body
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out


def wait_state(mark: str, state: str, bound: float, request: "Streamed") -> bool:
    """Whether the request reached ``state`` (within ``bound``, and before it ended)."""
    want = {"computing": ("saving", 1), "mid-push": ("posted", 1), "pushed": ("posted", tiny_llama.LAYERS)}[state]
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and request.ended is None:
        lines = open(mark).read().split() if os.path.exists(mark) else []
        if lines.count(want[0]) >= want[1]:
            return True
        time.sleep(0.02)
    return False


def until_idle(kind: str, since: float, bound: float) -> Optional[float]:
    deadline = since + bound
    while time.monotonic() < deadline:
        if idle(kind):
            return time.monotonic() - since
        time.sleep(0.25)
    return None


def router_sees_all_up(bound: float) -> bool:
    """Waits until the router counts no engine down (its probes found the last cell's engines
    back)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORTS['router']}/kvx/stats", timeout=2))
            if not stats["prefill_down"] and not stats["decode_down"]:
                return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


def cell(cluster: Cluster, model: str, references: List[str], index: int, fault: str, state: str,
         hang_bound: float) -> Dict[str, Any]:
    """One cell: prompt ``2 * index`` meets the fault, ``2 * index + 1`` is the next request.
    Begins once both engines are idle and the router sees them up."""
    for kind in ("decode", "prefill"):
        until_idle(kind, time.monotonic(), 60)
    router_sees_all_up(30)
    if os.path.exists(cluster.mark):
        os.remove(cluster.mark)
    reference = references[2 * index]
    request = Streamed(model, prompt(2 * index), hang_bound)
    row: Dict[str, Any] = {"fault": fault, "state": state}
    if not wait_state(cluster.mark, state, 120, request):
        request.thread.join(hang_bound)
        row["outcome"] = f"state not reached (the request: {request.error or 'answered'})"
        return row
    faulted = time.monotonic()
    stopped: List[str] = []
    restore = None
    if fault.endswith("-killed"):
        cluster.signal(fault.split("-")[0], signal.SIGKILL)
    elif fault.endswith("-hung"):
        kind = fault.split("-")[0]
        cluster.signal(kind, signal.SIGSTOP)
        stopped.append(kind)
    elif fault.startswith("link-down"):
        link(False)
        seconds = float(fault.rsplit("-", 1)[1].rstrip("s"))
        restore = threading.Timer(seconds, link, (True,))
        restore.start()
    elif fault == "client-gone":
        request.abort()
    request.thread.join(hang_bound)
    if request.ended is None:
        row["outcome"] = "HANG"
    elif fault == "client-gone":
        row["outcome"] = "client gone"
    elif request.error:
        row["outcome"] = "typed failure: " + request.error
    elif request.got == reference:
        row["outcome"] = "correct"
    else:
        row["outcome"] = f"WRONG TOKENS: {request.got!r}"
    row["client_s"] = None if request.ended is None else round(request.ended - faulted, 2)
    for kind in ("decode", "prefill"):
        dead = kind in stopped or (fault == f"{kind}-killed")
        took = None if dead else until_idle(kind, faulted, 60)
        row[f"{kind}_idle_s"] = "-" if dead else (round(took, 2) if took is not None else "> 60")
    if restore is not None:
        restore.join()
    back = 0.0
    for kind in ("prefill", "decode"):
        if fault.startswith(kind) and (fault.endswith("-killed") or fault.endswith("-hung")):
            back += cluster.restart(kind)
    nxt = Streamed(model, prompt(2 * index + 1), hang_bound)
    nxt.thread.join(hang_bound)
    row["next"] = "correct" if (nxt.ended and not nxt.error and nxt.got == references[2 * index + 1]) else \
        f"not: {nxt.error or repr(nxt.got)}"
    row["restart_s"] = round(back, 1) if back else None
    return row


def reference_answers(model: str, logdir: str, count: int) -> List[str]:
    """The first ``count`` prompts' answers from one engine that is not disaggregated."""
    proc, port = engine("single", model, logdir)
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT)

        def answer(index: int) -> str:
            body = json.dumps({"model": model, "prompt": prompt(index), "max_tokens": MAX_TOKENS,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.load(r)["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(answer, range(count)))
    finally:
        proc.stop()


def short(outcome: str) -> str:
    """An outcome as the table gives it: a typed failure by its status and type alone."""
    found = re.match(r"typed failure: (?:event )?(\d+ )?(\w+)", outcome)
    return f"typed failure (`{(found.group(1) or '')}{found.group(2)}`)" if found else outcome


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| fault | state | outcome at the client | client s | decode idle s | prefill idle s | next request |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        nxt = r.get("next", "")
        if r.get("restart_s"):
            nxt += f" (engine back in {r['restart_s']} s)"
        out.append(f"| {r['fault']} | {r['state']} | {short(str(r.get('outcome')))} | {r.get('client_s', '')} | "
                   f"{r.get('decode_idle_s', '')} | {r.get('prefill_idle_s', '')} | {nxt} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--states", default=",".join(STATES), help=f"comma-separated, of {', '.join(STATES)}")
    ap.add_argument("--connector", default="kvx", help="kvx (the only one wired so far)")
    ap.add_argument("--policy", default="recompute", help="the decode engine's kv_load_failure_policy")
    ap.add_argument("--hang-bound", type=float, default=120.0, help="a request not ended after this is a HANG")
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
    logdir = tempfile.mkdtemp(prefix="kvx-fault-matrix-")
    model = tiny_llama.make(os.path.join(logdir, "model"))
    os.environ.setdefault("KVX_E2E_SLOW_SAVE_SEC", "1.5")
    references = reference_answers(model, logdir, 2 * len(faults) * len(states))
    cluster = Cluster(model, logdir, args.connector, args.policy)
    rows: List[Dict[str, Any]] = []
    began = time.monotonic()
    try:
        cluster.up()
        cells = [(f, s) for f in faults for s in states]
        for index, (fault, state) in enumerate(cells):
            row = cell(cluster, model, references, index, fault, state, args.hang_bound)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        cluster.down()
        link(True)
    print(f"\n{args.connector} connector, kv_load_failure_policy {args.policy}, "
          f"{len(rows)} cells in {time.monotonic() - began:.0f} s (logs: {logdir})\n")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if str(r.get("outcome", "")).startswith(("HANG", "WRONG"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
