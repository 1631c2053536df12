"""The fault matrix of ``docs/reliability.md``: real vLLM engines (the CPU build) with a KV
connector, each engine in a network namespace of its own, kvx's router and the client in the
host's. For each fault, at each state of a request, one streamed request meets the fault, and
the cell records the outcome and how long it took:

- **outcome** at the client (through the router): ``correct`` (the single engine's tokens),
  ``typed failure`` (an OpenAI error object or error event, with its type), ``UNTYPED
  failure`` (the connection cut without an answer), ``WRONG TOKENS``, or ``HANG`` (no end
  within ``--hang-bound``);
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
``KVX_E2E_SLOW_SAVE_SEC``; the decode engine's holds a request where told to):
``computing`` (the prefill engine's first layer is being computed: the reservation is
claimed, nothing written), ``grant-pending`` (the same, with the decode engine's reservation
held back for ``HOLD_S``: the claim waits for its grant), ``mid-push`` (one layer's writes
posted, the next being computed), ``pushed`` (every layer's writes posted), ``delivered``
(every byte has arrived; the decode engine holds the request from vLLM's scheduler for
``HOLD_S``).

Connectors (``--connectors``, each with engines of its own, one after the other):

- ``kvx``: ``KvxConnector`` behind kvx's router (``python -m kvx.vllm.router``), which sends
  each request to both engines at once.
- ``nixl``: vLLM's ``NixlConnector`` (NIXL over UCX's TCP transport on the prefill–decode
  link: ``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` its veth, so that the link's faults reach it as
  they reach kvx), sent as vLLM's example proxy sends it: the prefill engine first
  (``do_remote_decode``, one token), then the decode engine with the prefill engine's
  ``kv_transfer_params``. This script is that proxy; what it gets is what a client of vLLM's
  example proxy would get. NIXL's decode engine reads the KV once the prefill engine has
  answered, so its states name only how far the prefill engine has computed.

``prefill-preempted`` is a row of its own, on a prefill engine started to run out of KV
blocks (``PREEMPT_ARGS``): three requests at once, each prefilled a block a step, outgrow its
cache mid-push and vLLM's scheduler preempts one (counted by ``vllm:num_preemptions_total``;
a cell without a preemption is "state not reached"); it is recomputed and pushed again.

``--in-flight N`` sends N requests at once in each cell (the fault comes when the first reaches
the state) and N next requests; a cell's outcome counts them.

Run by ``scripts/fault-matrix.sh``, which makes the namespaces and veth pairs, and removes
them; as root. Prints a Markdown table and writes JSON (``--out``). Exits 1 when a kvx cell
hangs or answers wrong tokens (those of another connector are what it measures)."""

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
#: Each engine's end of the prefill–decode link (NIXL's UCX is told to use it).
PD_DEVICE = {"prefill": "kvxfm-pd0", "decode": "kvxfm-pd1"}
PORTS = {"prefill": 8100, "decode": 8200, "alloc": 8400, "fabric": 8300, "router": 8000, "nixl": 5600}
CONNECTORS = ["kvx", "nixl"]
MAX_TOKENS = 16
FAULTS = ["prefill-killed", "prefill-hung", "decode-killed", "decode-hung", "link-down-1s", "link-down-30s",
          "client-gone", "prefill-preempted"]
#: The prefill engine of the preemption row: room for 9 blocks (vLLM keeps one: the least that
#: holds one 1,024-token sequence), each request's prefill one block a step beside the others', so that
#: three prompts of three blocks outgrow the KV cache in their third step and vLLM preempts
#: the last one mid-push (it is recomputed later).
PREEMPT_ARGS = "--num-gpu-blocks-override 9 --max-num-batched-tokens 384 --long-prefill-token-threshold 128"
PREEMPT_IN_FLIGHT = 3
STATES = ["computing", "grant-pending", "mid-push", "pushed", "delivered"]
#: How long the decode engine holds a request in the states it holds (``slow_connector.py``'s
#: control file): longer than the prefill engine's compute, shorter than the hang bound.
HOLD_S = 6
#: What each state waits for in the mark file (a line, how many times), and what the decode
#: engine is told to hold. ``grant-pending``: the prefill engine's claim is made (a layer
#: being saved) and the decode engine's reservation is being held back; ``delivered``: the
#: decode engine has every byte, and vLLM has not been told yet.
STATE_MARKS: Dict[str, Tuple[Tuple[Tuple[str, int], ...], Optional[str]]] = {
    "computing": ((("saving", 1),), None),
    "grant-pending": ((("saving", 1), ("reserving", 1)), "grant"),
    "mid-push": ((("posted", 1),), None),
    "pushed": ((("posted", tiny_llama.LAYERS),), None),
    "delivered": ((("delivered", 1),), "delivered"),
}
#: The states a connector lacks, or that this script cannot hold it in: NIXL grants nothing,
#: and its decode side reports a finished read other than through ``get_finished``'s return
#: in the vLLM measured (the hold of ``slow_connector.py`` never saw one).
NO_SUCH_STATE = {"nixl": {"grant-pending", "delivered"}}


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
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_preemptions_total"):
        found = re.findall(r"^vllm:%s\{[^}]*\} ([0-9.e+-]+)$" % name, text, re.M)
        out[name] = sum(float(v) for v in found) if found else float("nan")
    return out


def idle(kind: str) -> bool:
    m = metrics(kind)
    return m is not None and m["kv_cache_usage_perc"] == 0.0 and m["num_requests_running"] == 0.0


class Cluster:
    """The engines and the router; ``restart`` brings one engine back on its ports."""

    def __init__(self, model: str, logdir: str, connector: str, policy: str, prefill_args: str = "") -> None:
        self.model, self.logdir, self.connector, self.policy = model, logdir, connector, policy
        #: Engine arguments of the prefill engine's own (``PREEMPT_ARGS``).
        self.prefill_args = prefill_args
        self.mark = os.path.join(logdir, "marks")
        self.control = os.path.join(logdir, "control")
        self.procs: Dict[str, Process] = {}
        self.starts = 0

    def _kv(self, kind: str) -> Dict[str, Any]:
        if self.connector == "kvx":
            if kind == "decode":
                return {"kv_connector": "SlowKvxConnector", "kv_connector_module_path": "slow_connector",
                        "kv_role": "kv_consumer", "kv_load_failure_policy": self.policy,
                        "kv_connector_extra_config": {"host": PD_ADDR["decode"], "alloc_port": PORTS["alloc"],
                                                      "fabric_port": PORTS["fabric"]}}
            return {"kv_connector": "SlowKvxConnector", "kv_connector_module_path": "slow_connector",
                    "kv_role": "kv_producer", "kv_connector_extra_config": {}}
        if kind == "decode":
            return {"kv_connector": "SlowNixlConnector", "kv_connector_module_path": "slow_connector",
                    "kv_role": "kv_both", "kv_buffer_device": "cpu", "kv_load_failure_policy": self.policy}
        return {"kv_connector": "SlowNixlConnector", "kv_connector_module_path": "slow_connector",
                "kv_role": "kv_both", "kv_buffer_device": "cpu"}

    def start(self, kind: str) -> None:
        env = {"KVX_E2E_MARK": self.mark, "KVX_E2E_ROLE": kind, "KVX_E2E_CONTROL": self.control}
        if self.connector == "nixl":
            # The side channel and UCX's transfers over the prefill–decode link.
            env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": PD_ADDR[kind], "VLLM_NIXL_SIDE_CHANNEL_PORT": str(PORTS["nixl"]),
                        "UCX_TLS": "tcp", "UCX_NET_DEVICES": PD_DEVICE[kind]})
        self.starts += 1
        own = self.prefill_args if kind == "prefill" else ""
        before = os.environ.get("KVX_E2E_ENGINE_ARGS", "")
        os.environ["KVX_E2E_ENGINE_ARGS"] = f"{before} {own}".strip()
        try:
            proc, _ = engine(f"{kind}-{self.starts}", self.model, self.logdir, self._kv(kind), env=env,
                             netns=NETNS[kind], port=PORTS[kind])
        finally:
            os.environ["KVX_E2E_ENGINE_ARGS"] = before
        self.procs[kind] = proc

    def wait_up(self, kind: str) -> None:
        self.procs[kind].wait_http(f"http://{HTTP_ADDR[kind]}:{PORTS[kind]}/health", START_TIMEOUT)

    def up(self) -> None:
        for kind in ("decode", "prefill"):
            self.start(kind)
        for kind in ("decode", "prefill"):
            self.wait_up(kind)
        if self.connector != "kvx":
            return  # this script is the proxy
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
    """One streamed completion, read in a thread of its own: its text, the error it ended
    with, and when it ended. Through kvx's router (``kvx``), or as vLLM's example proxy sends
    a ``NixlConnector`` request (``nixl``): the prefill engine first, then the decode engine."""

    def __init__(self, model: str, text: str, hang_bound: float, connector: str = "kvx") -> None:
        self.model, self.text, self.hang_bound, self.connector = model, text, hang_bound, connector
        self.got = ""
        self.error: Optional[str] = None
        self.status: Optional[int] = None
        self.ended: Optional[float] = None
        self.sock: Optional[socket.socket] = None
        self.aborted = False
        #: Whether the error was an answer (an OpenAI error object or error event), not a cut.
        self.typed = True
        #: Nothing came for ``hang_bound`` (this proxy gave up).
        self.hung = False
        self.leg = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body: Dict[str, Any] = {"model": self.model, "prompt": self.text, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "stream": True}
        try:
            if self.connector == "kvx":
                status, raw = self._exchange("router", ("127.0.0.1", PORTS["router"]), body)
            else:
                status, raw = self._exchange("prefill", (HTTP_ADDR["prefill"], PORTS["prefill"]), {
                    **body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
                        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}})
                if status != 200:
                    self._parse(status, raw, "prefill ")
                    return
                params = json.loads(_dechunk(raw))["kv_transfer_params"]
                status, raw = self._exchange("decode", (HTTP_ADDR["decode"], PORTS["decode"]),
                                             {**body, "kv_transfer_params": params})
            self._parse(status, raw, "")
        except socket.timeout:
            self.hung = True  # no byte for hang_bound: what the cell calls a hang
        except (OSError, ValueError, KeyError) as e:
            if not self.error:
                self.error, self.typed = f"{self.leg} connection: {e!r}", False
        finally:
            self.ended = time.monotonic()

    def _exchange(self, leg: str, address: Tuple[str, int], body: Dict[str, Any]) -> Tuple[Optional[int], bytes]:
        """One HTTP/1.1 POST to /v1/completions, read to its end: (status, body)."""
        self.leg = leg
        data = json.dumps(body).encode()
        sock = socket.create_connection(address, timeout=self.hang_bound)
        self.sock = sock
        if self.aborted:
            raise OSError("the client went away")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        raw = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
        sock.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        return (int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else None), rest

    def _parse(self, status: Optional[int], body: bytes, leg: str) -> None:
        self.status = status
        if status is None:
            self.error = f"{leg}connection closed without an answer"
            self.typed = False
            return
        if status != 200:
            try:
                error = json.loads(_dechunk(body))["error"]
                self.error = f"{leg}{status} {error.get('type')}: {str(error.get('message'))[:100]}"
            except (ValueError, KeyError, TypeError):
                self.error = f"{leg}{status}: {body[:100]!r}"
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
        self.aborted = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
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


def wait_state(mark: str, state: str, bound: float, requests: List["Streamed"]) -> bool:
    """Whether a request reached ``state`` (within ``bound``, and before they all ended)."""
    wants = STATE_MARKS[state][0]
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and any(r.ended is None for r in requests):
        lines = open(mark).read().split() if os.path.exists(mark) else []
        if all(lines.count(word) >= n for word, n in wants):
            return True
        time.sleep(0.02)
    return False


class IdleWatch:
    """Samples an engine from a fault on (every 0.25 s, in a thread of its own) and says
    when it was idle for good: the time from the fault past its last busy sample, once the
    requests have ended and it is idle. 0 for an engine that held nothing throughout."""

    def __init__(self, kind: str, since: float) -> None:
        self.kind, self.since = kind, since
        self.last_busy: Optional[float] = None
        self.settled = threading.Event()
        self.ended: Optional[float] = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            if idle(self.kind):
                if self.ended is not None and now >= self.ended:
                    self.settled.set()
                    return
            else:
                self.last_busy = now
            if self.ended is not None and now > self.ended + 60:
                return
            time.sleep(0.25)

    def result(self, ended: float) -> Optional[float]:
        """Seconds from the fault until idle for good, given when the requests ended; None
        when it was still busy 60 s after."""
        self.ended = ended
        self._thread.join(65)
        if not self.settled.is_set():
            return None
        return 0.0 if self.last_busy is None else self.last_busy + 0.25 - self.since


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


def outcome(request: "Streamed", reference: str, fault: str) -> str:
    if request.ended is None or request.hung:
        return "HANG"
    if fault == "client-gone":
        return "client gone"
    if request.error:
        return ("typed failure: " if request.typed else "UNTYPED failure: ") + request.error
    if request.got == reference:
        return "correct"
    return f"WRONG TOKENS: {request.got!r}"


def counted(outcomes: List[str]) -> str:
    """One outcome, or each distinct one with its count (``3× correct, 5× typed failure: …``)."""
    if len(set(outcomes)) == 1 and len(outcomes) == 1:
        return outcomes[0]
    distinct = sorted(set(outcomes), key=outcomes.index)
    return ", ".join(f"{outcomes.count(o)}× {o}" for o in distinct)


def cell(cluster: Cluster, model: str, references: List[str], index: int, fault: str, state: str,
         hang_bound: float, in_flight: int = 1) -> Dict[str, Any]:
    """One cell: prompts ``2N·index …`` (N = ``in_flight``) meet the fault, the N after them
    are the next requests. Begins once both engines are idle (and the router sees them up)."""
    for kind in ("decode", "prefill"):
        until_idle(kind, time.monotonic(), 60)
    if cluster.connector == "kvx":
        router_sees_all_up(30)
    if os.path.exists(cluster.mark):
        os.remove(cluster.mark)
    hold = STATE_MARKS[state][1]
    if hold:
        with open(cluster.control, "w") as f:
            f.write(f"{hold} {HOLD_S}")
    base = 2 * in_flight * index
    preemptions = (metrics("prefill") or {}).get("num_preemptions_total", 0.0)
    requests = [Streamed(model, prompt(base + j), hang_bound, cluster.connector) for j in range(in_flight)]
    row: Dict[str, Any] = {"connector": cluster.connector, "fault": fault, "state": state}
    if in_flight > 1:
        row["in_flight"] = in_flight
    reached = wait_state(cluster.mark, state, 120, requests)
    if os.path.exists(cluster.control):
        os.remove(cluster.control)  # what is held stays held; the next requests are not
    if not reached:
        for r in requests:
            r.thread.join(hang_bound)
        row["outcome"] = f"state not reached (the requests: {[r.error or 'answered' for r in requests]})"
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
        for r in requests:
            r.abort()
    # prefill-preempted: nothing to do; the prefill engine's own scheduler preempts.
    watches = {kind: IdleWatch(kind, faulted) for kind in ("decode", "prefill")
               if kind not in stopped and fault != f"{kind}-killed"}
    for r in requests:
        r.thread.join(max(0.0, faulted + hang_bound - time.monotonic()))
    row["outcome"] = counted([outcome(r, references[base + j], fault) for j, r in enumerate(requests)])
    if fault == "prefill-preempted":
        preempted = (metrics("prefill") or {}).get("num_preemptions_total", 0.0) - preemptions
        if not preempted > 0:
            row["outcome"] = f"state not reached (no preemption; the requests: {row['outcome']})"
        row["preemptions"] = preempted
    ends = [r.ended for r in requests]
    row["client_s"] = None if None in ends else round(max(e for e in ends if e is not None) - faulted, 2)
    ended = max([e for e in ends if e is not None] + [time.monotonic()])
    for kind in ("decode", "prefill"):
        if kind not in watches:
            row[f"{kind}_idle_s"] = "-"
            continue
        took = watches[kind].result(ended)
        row[f"{kind}_idle_s"] = round(took, 2) if took is not None else "busy 60 s after the end"
    if restore is not None:
        restore.join()
    back = 0.0
    for kind in ("prefill", "decode"):
        if fault.startswith(kind) and (fault.endswith("-killed") or fault.endswith("-hung")):
            back += cluster.restart(kind)
    nexts = [Streamed(model, prompt(base + in_flight + j), hang_bound, cluster.connector) for j in range(in_flight)]
    for r in nexts:
        r.thread.join(hang_bound)
    row["next"] = counted([outcome(r, references[base + in_flight + j], "") for j, r in enumerate(nexts)])
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
    """An outcome as the table gives it: a typed failure by its leg, status and type alone."""

    def one(text: str) -> str:
        found = re.match(r"(\d+× )?typed failure: (?:event )?((?:prefill |decode |router )?)(\d+ )?(\w+)", text)
        if not found:
            return text
        return f"{found.group(1) or ''}typed failure (`{found.group(2)}{found.group(3) or ''}{found.group(4)}`)"

    return ", ".join(one(part) for part in re.split(r", (?=\d+× )", outcome))


def table(rows: List[Dict[str, Any]]) -> str:
    out = ["| connector | fault | state | outcome at the client | client s | decode idle s | prefill idle s | next request |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        nxt = short(str(r.get("next", "")))
        if r.get("restart_s"):
            nxt += f" (engine back in {r['restart_s']} s)"
        out.append(f"| {r.get('connector', 'kvx')} | {r['fault']} | {r['state']} | {short(str(r.get('outcome')))} | "
                   f"{r.get('client_s', '')} | {r.get('decode_idle_s', '')} | {r.get('prefill_idle_s', '')} | {nxt} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--states", default=",".join(STATES), help=f"comma-separated, of {', '.join(STATES)}")
    ap.add_argument("--connectors", default=",".join(CONNECTORS),
                    help=f"comma-separated, of {', '.join(CONNECTORS)}: each with engines of its own, in turn")
    ap.add_argument("--in-flight", type=int, default=1, help="requests at once in each cell (default 1)")
    ap.add_argument("--policy", default="recompute", help="the decode engine's kv_load_failure_policy")
    ap.add_argument("--hang-bound", type=float, default=120.0, help="a request not ended after this is a HANG")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    states = [s for s in args.states.split(",") if s]
    connectors = [c for c in args.connectors.split(",") if c]
    for f in faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r} (known: {', '.join(FAULTS)})")
    for s in states:
        if s not in STATES:
            ap.error(f"unknown state {s!r} (known: {', '.join(STATES)})")
    for c in connectors:
        if c not in CONNECTORS:
            ap.error(f"unknown connector {c!r} (known: {', '.join(CONNECTORS)})")
    if args.in_flight < 1:
        ap.error("--in-flight must be at least 1")
    logdir = tempfile.mkdtemp(prefix="kvx-fault-matrix-")
    model = tiny_llama.make(os.path.join(logdir, "model"))
    os.environ.setdefault("KVX_E2E_SLOW_SAVE_SEC", "1.5")
    # The preemption row has engines of its own (PREEMPT_ARGS), and one state: vLLM's
    # scheduler picks the moment, mid-push.
    cells = [(f, s) for f in faults if f != "prefill-preempted" for s in states]
    preempt = ["prefill-preempted"] if "prefill-preempted" in faults else []
    in_flight = max(args.in_flight, PREEMPT_IN_FLIGHT) if preempt else args.in_flight
    references = reference_answers(model, logdir, 2 * in_flight * (len(cells) + len(preempt)))
    rows: List[Dict[str, Any]] = []
    began = time.monotonic()
    for connector in connectors:
        runs = [("", cells, args.in_flight)] if cells else []
        runs += [(PREEMPT_ARGS, [(f, "mid-push") for f in preempt], in_flight)] if preempt else []
        for prefill_args, these, n in runs:
            cluster = Cluster(model, os.path.join(logdir, connector), connector, args.policy, prefill_args)
            os.makedirs(cluster.logdir, exist_ok=True)
            try:
                cluster.up()
                for fault, state in these:
                    if state in NO_SUCH_STATE.get(connector, ()):
                        continue
                    index = (cells + [(f, "mid-push") for f in preempt]).index((fault, state))
                    row = cell(cluster, model, references, index, fault, state, args.hang_bound, n)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                cluster.down()
                link(True)
    bad_count = sum(1 for r in rows if re.search(r"HANG|WRONG|UNTYPED|not reached", str(r.get("outcome"))))
    print(f"\n{len(rows)} cells in {time.monotonic() - began:.0f} s, {bad_count} hung, wrong, untyped or not reached: "
          f"{', '.join(connectors)}; kv_load_failure_policy {args.policy}; {args.in_flight} request(s) in flight "
          f"(logs: {logdir})\n")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if r["connector"] == "kvx" and re.search(r"HANG|WRONG|UNTYPED|not reached", str(r.get("outcome")))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
