"""``tierkv serve --parallel``: short requests during a long answer, one at a time and side by side.

Two servers share one store, one started with ``--parallel 1``, the other with ``--parallel 2`` (or
``--parallel N``); each reads a real-text document (``reuse.document``) once, untimed. Then, per round
and server in turns: one client asks for a long answer about the document, and while it runs
``--short`` others, a moment apart, ask short questions about it. Greedy, so both servers give the
same text, which the bench checks. Flags this script does not know go to both servers (``--mode``,
``--dtype``, the budgets)::

    short_wait_serial_vs_parallel     median seconds from a short request to its whole answer, one at
                                      a time / side by side
    tokens_per_s_parallel_vs_serial   generated tokens a second over a round, every client together

Each figure is its better round on each server.

    python bench/serve_parallel.py --out serve_parallel.json
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx

from report import Help, Report, machine, out_file, stop_on_sigterm, whole
from reuse import document
from serve_start import free_port

LONG = "Summarize what this document explains, topic by topic."
SHORT = ("Which statement ends a loop?", "What does the pass statement do?", "What is a nonlocal name?",
         "How is an exception raised?", "What does import do?", "When does a while loop stop?")


@dataclass
class Server:
    parallel: int
    store: str
    extra: list[str]
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        cmd = [sys.executable, "-m", "tierkv", "serve", "--port", str(self.port), "--nvme-dir", self.store,
               "--parallel", str(self.parallel), "--served-name", "smollm2", *self.extra]
        self.log = open(f"{self.store}.parallel-{self.parallel}.log", "w+")     # (a pipe nobody reads fills up)
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"tierkv serve --parallel {self.parallel} exited: {self.log.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"tierkv serve --parallel {self.parallel} did not start in 300 s")

    def ask(self, doc: str, question: str, tokens: int) -> tuple[float, str, int]:
        """Seconds to the whole answer, its text and its tokens."""
        began = time.perf_counter()
        reply = httpx.post(f"{self.url}/v1/chat/completions", timeout=900, json={
            "model": "smollm2", "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": doc}, {"role": "user", "content": question}]})
        reply.raise_for_status()
        body = reply.json()
        return time.perf_counter() - began, body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def one_round(server: Server, doc: str, args: argparse.Namespace) -> dict:
    """The long answer, and the short ones sent ``--gap`` seconds apart once it began."""
    got: dict[str, tuple[float, str, int]] = {}
    errors: list[BaseException] = []

    def ask(name: str, question: str, tokens: int) -> None:
        try:
            got[name] = server.ask(doc, question, tokens)
        except BaseException as error:       # noqa: BLE001 - raised on the main thread below
            errors.append(error)

    began = time.perf_counter()
    threads = [threading.Thread(target=ask, args=("long", LONG, args.long))]
    threads[0].start()
    for i, question in enumerate(SHORT[:args.short]):
        time.sleep(args.gap)
        threads.append(threading.Thread(target=ask, args=(f"short{i}", question, args.tokens)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    wall = time.perf_counter() - began
    shorts = [got[f"short{i}"] for i in range(args.short)]
    return {"wall_s": wall, "long_s": got["long"][0], "short_median_s": statistics.median(s[0] for s in shorts),
            "tokens": sum(g[2] for g in got.values()), "texts": [got["long"][1], *(s[1] for s in shorts)]}


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--parallel", type=whole(2), default=2, help="the side-by-side server's --parallel")
    parser.add_argument("--short", type=whole(1), default=3, help=f"short requests a round (at most {len(SHORT)})")
    parser.add_argument("--long", type=whole(1), default=128, help="new tokens of the long answer at most")
    parser.add_argument("--tokens", type=whole(1), default=16, help="new tokens of a short answer at most")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between one request and the next")
    parser.add_argument("--context", type=whole(64), default=2048, help="the document's tokens, about")
    parser.add_argument("--rounds", type=whole(1), default=2, help="rounds on each server (the better counts)")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    args, extra = parser.parse_known_args(argv)   # the rest goes to both servers (--mode, --dtype, budgets)
    if args.short > len(SHORT):
        parser.error(f"--short {args.short}: at most {len(SHORT)} (the questions this bench has)")
    if not args.gap >= 0:
        parser.error(f"--gap {args.gap}: must be >= 0")
    stop_on_sigterm()
    start = time.perf_counter()
    from tierkv.model.loading import load_model
    with tempfile.TemporaryDirectory(prefix="tierkv-serve-parallel-") as scratch:
        report = Report("serve_parallel", False, machine(scratch))
        doc = document(load_model("smollm2").tokenizer, args.context)
        servers: list[Server] = []
        try:
            for parallel in (1, args.parallel):
                servers.append(Server(parallel, f"{scratch}/store", extra))
            for server in servers:
                server.ask(doc, SHORT[0], 2)                      # the document's read (stored), untimed
            rounds: dict[int, list[dict]] = {server.parallel: [] for server in servers}
            for _ in range(args.rounds):
                for server in servers:
                    rounds[server.parallel].append(one_round(server, doc, args))
        finally:
            for server in servers:
                server.stop()
    same = len({tuple(r["texts"]) for runs in rounds.values() for r in runs}) == 1
    best = {}                                     # each figure's better round, per server
    for p, runs in rounds.items():
        best[p] = {"tokens_per_s": max(r["tokens"] / r["wall_s"] for r in runs),
                   "short_median_s": min(r["short_median_s"] for r in runs), "long_s": min(r["long_s"] for r in runs)}
        report.add_row(f"parallel-{p}", "tokens_per_s", round(best[p]["tokens_per_s"], 2), "tok/s",
                       short_median_s=round(best[p]["short_median_s"], 3), long_s=round(best[p]["long_s"], 3),
                       tokens=runs[0]["tokens"], short=args.short, same_text=same)
    serial, parallel = best[1], best[args.parallel]
    report.add_ratio("short_wait_serial_vs_parallel", round(serial["short_median_s"] / parallel["short_median_s"], 3),
                     None, f"median seconds to a short answer's end while a long one runs, --parallel 1 / "
                           f"--parallel {args.parallel}")
    report.add_ratio("tokens_per_s_parallel_vs_serial", round(parallel["tokens_per_s"] / serial["tokens_per_s"], 3),
                     None, "generated tokens a second over a round, every client together")
    report.add_bound("side by side, prompts are still computed one at a time and every answer reads the weights "
                     "once a step (no batching): a short answer waits for no long one, but the cores are shared")
    report.finish(start, args.out)
    if not same:
        print("serve_parallel: the answers differ between the servers or rounds", file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
