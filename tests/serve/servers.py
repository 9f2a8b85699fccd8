"""A real ``tierkv serve`` process on a free local port, talked to over HTTP."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

API_KEY = "test-key"


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    loading: list[httpx.Response] = field(default_factory=list)   # /health and a completion while it loaded

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=30).json()

    def idle(self, timeout: float = 120) -> dict:
        """/health once the worker has nothing to do."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.health()
            if not state["busy"] and state["queue"] == 0:
                return state
            time.sleep(0.2)
        raise AssertionError("the server stayed busy")

    def settled(self, timeout: float = 60) -> dict:
        """/health once the worker is idle and no block is pinned (write-backs to the store run on after
        an answer); a block still pinned at ``timeout`` is a leak."""
        deadline = time.monotonic() + timeout
        state = self.idle(timeout)
        while state["pinned_blocks"] and time.monotonic() < deadline:
            time.sleep(0.2)
            state = self.health()
        assert state["pinned_blocks"] == 0, f"{state['pinned_blocks']} block(s) stayed pinned"
        return state

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path: Path, *args: str, key: str | None = API_KEY) -> Server:
    port, log = free_port(), tmp_path / f"serve-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "tierkv", "serve", "--port", str(port), *args]
    if key is not None:
        cmd += ["--api-key", key]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    server, deadline = Server(f"http://127.0.0.1:{port}", process, log), time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"tierkv serve exited {process.returncode}: {log.read_text()}")
        try:
            health = httpx.get(f"{server.url}/health", timeout=2)
            if health.status_code == 200:
                return server
            if not server.loading:
                server.loading += [health, httpx.post(f"{server.url}/v1/completions", timeout=2,
                                                      json={"model": "x", "prompt": "hi"})]
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"tierkv serve did not start: {log.read_text()}")
