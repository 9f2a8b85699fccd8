"""Real servers the tests start on free local ports: a ``redis-server`` process (the Debian package;
the set-up installs it) and nothing else. A missing server is a failure, not a skip."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` on a free port with its files in ``directory``; ``kill`` and ``start`` again at will."""

    def __init__(self, directory: Path, *, password: str | None = None, maxmemory: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: `apt-get install -y redis-server` "
                               "(make test installs it)")
        self.binary, self.directory, self.password, self.maxmemory = binary, directory, password, maxmemory
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.started = False

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start it and wait until it answers. A first start whose port another process took meanwhile
        (tests run in parallel) moves to a new free port; a restart keeps the port its clients know."""
        args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        for _ in range(5):
            self.process = subprocess.Popen([self.binary, "--port", str(self.port), *args],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._answers():
                self.started = True
                return self
            if self.process.poll() is None:
                break                          # alive but silent for 10 s
            if not self.started:
                self.port = free_port()        # it exited: its port was taken
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _answers(self) -> bool:
        """Whether this process, not another on its port, answers within 10 s (its ``process_id``)."""
        import redis
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                                 socket_timeout=0.5, socket_connect_timeout=0.2) as client:
                    return client.info("server")["process_id"] == self.process.pid
            except redis.RedisError:
                time.sleep(0.05)
        return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def client(self):
        import redis
        return redis.Redis.from_url(self.url)
