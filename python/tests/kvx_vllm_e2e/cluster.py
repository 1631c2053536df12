"""Launching real vLLM engines (the CPU build) and kvx's router as processes of their own,
for the end-to-end tests (``test_end_to_end.py``) and the connector benchmark
(``python/bench/vllm_connectors.py``): a free port, a server process with its output in a log
file and a bounded wait for its health, and an engine's command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from kvx.testing import free_port

HERE = os.path.dirname(os.path.abspath(__file__))

#: How long one engine may take to start (2 cores, two engines starting at once).
START_TIMEOUT = 420


class Process:
    """A server process with its output in a log file; stopped (SIGTERM, then SIGKILL) by
    ``stop``."""

    def __init__(self, name: str, args: List[str], logdir: str, env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                urllib.request.urlopen(url, timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"{self.name} not up within {timeout} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def engine(name: str, model: str, logdir: str, kv: Optional[Dict[str, Any]] = None,
           env: Optional[Dict[str, str]] = None, cpus: Optional[str] = None,
           netns: Optional[str] = None, port: Optional[int] = None) -> Tuple[Process, int]:
    """A vLLM OpenAI server for ``model`` on ``port`` (default: a free one), with ``kv`` as
    its ``--kv-transfer-config``; returns it and its port. ``KVX_E2E_ENGINE_ARGS`` adds
    arguments of one's own to every engine (a benchmark's variations). ``cpus`` (a
    ``taskset -c`` list) pins the engine's processes and its compute threads to those CPUs;
    ``netns`` runs it in that network namespace (``ip netns exec``, which keeps the pid, so
    signals to the process group reach the engine)."""
    port = port or free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
            "--gpu-memory-utilization", "0.2", "--seed", "0"]
    args += os.environ.get("KVX_E2E_ENGINE_ARGS", "").split()
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    if cpus is not None:
        args = ["taskset", "-c", cpus, *args]
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    return Process(name, args, logdir, env), port


