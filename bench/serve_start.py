"""How soon a starting ``tierkv serve`` answers: a client polls /health from the moment the command
starts and counts the connections refused before the first answer (a loading server's 503).

    .venv/bin/python bench/serve_start.py [--runs 3]

The server is started twice per run, in turns: through the ``tierkv`` command (``python -m tierkv``,
which listens before it imports the model stack) and through ``python -m tierkv.cli`` (the same server,
listening only once its flags are checked, after the imports), so both see the same machine."""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from report import Help, stop_on_sigterm, whole

ENTRIES = {"tierkv": [sys.executable, "-m", "tierkv"], "tierkv.cli": [sys.executable, "-m", "tierkv.cli"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_answer(entry: str, store: str) -> tuple[float, int]:
    """Seconds from the start to the first HTTP answer, and the connections refused before it."""
    port = free_port()
    began = time.monotonic()
    server = subprocess.Popen([*ENTRIES[entry], "serve", "--port", str(port), "--nvme-dir", store],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    refused = 0
    try:
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=60)
                return time.monotonic() - began, refused
            except httpx.ConnectError:
                refused += 1
                time.sleep(0.02)
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help)
    parser.add_argument("--runs", type=whole(1), default=3, help="starts timed (their median counts)")
    args = parser.parse_args()
    stop_on_sigterm()
    seen: dict[str, list[tuple[float, int]]] = {entry: [] for entry in ENTRIES}
    with tempfile.TemporaryDirectory() as store:
        for _ in range(args.runs):
            for entry in ENTRIES:
                seen[entry].append(first_answer(entry, store))
    for entry, runs in seen.items():
        print(f"{entry:11} first answer after {statistics.median(s for s, _ in runs):.2f} s (median of {len(runs)}), "
              f"connections refused before it: {', '.join(str(r) for _, r in runs)}")


if __name__ == "__main__":
    main()
