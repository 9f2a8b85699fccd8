"""Prefill once, ask many times: how long does a second question over a stored document take?

Per (mode, context): a real-text document (CPython's own documentation, ``pydoc_data``) of about
CTX tokens, SmolLM2, an NVMe store in a scratch directory::

    session     read the document (prefilled and stored: the first prefill), ask Q1
    server      tierkv serve started beside it on the same store: Q1 (the document found stored)
    both        Q2 asked of the session, then of the server, 5 times in turn (the median of each); the
                session's TTFT from the call to the first streamed piece of text, the server's measured
                by its HTTP client to the first content chunk: the same span a user sees

    ttft_question_vs_prefill@CTX   TTFT of Q2 in the session / (the document's prefill + Q1's TTFT)
    serve_overhead@CTX             server TTFT of Q2 / the session's TTFT of Q2 (both with the document
                                   held in memory)

Past the window (auto mode, no store): a document just inside SmolLM2's 8K window is read dense; a
question whose answer may run past the window is sparse from its prompt on. Its sparse state takes
the document's KV from the dense one; before, it prefilled the document again in sparse mode::

    ttft_past_window_vs_sparse_prefill   TTFT of that question / (a sparse prefill of the document +
                                         the same question's TTFT after it), medians of --tries

    python bench/reuse.py --quick --out bench/out/reuse-quick.json     dense 4K, sparse 12K
    python bench/reuse.py --out bench/out/reuse.json                   dense 8K, sparse 32K
"""
from __future__ import annotations

import os

# The server runs under the tierkv command, which makes idle OpenMP workers sleep (tierkv.cli): the
# session measured beside it runs under the same policy, so the ratio compares HTTP, not OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from report import Help, Report, machine, out_file, stop_on_sigterm, whole
from tierkv.model.loading import load_model
from tierkv.model.settings import SessionConfig
from tierkv.session import Session

QUESTIONS = ("What is this document about?", "Name one keyword the document explains.")
PAST_ANSWER = 1024               # max_tokens of the question past the window (its first pieces are measured)
BUDGETS = dict(gpu_budget="256MiB", cpu_budget="1GiB")
TARGETS = {"ttft_question_vs_prefill@32K": 0.02, "serve_overhead": 1.1}


def document(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of English reference text (CPython's topics, about 113K tokens, read
    again from the start when more are asked for)."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (n_tokens // len(ids) + 1))[:n_tokens]
    return tokenizer.decode(ids)


def measure_both(loaded, text: str, mode: str, store: Path, tries: int) -> tuple[dict, dict]:
    """The session first (its prefill is stored), then a server on the same store beside it; the
    second question is then asked of each in turn, ``tries`` times, so both see the same machine."""
    config = SessionConfig.of(model="smollm2", mode=mode, nvme_dir=store, **BUDGETS)
    with Session(config, loaded=loaded) as session:
        tokens = session.read(text)
        first = session.ask(QUESTIONS[0], max_new_tokens=8)
        port = _free_port()
        cmd = [sys.executable, "-m", "tierkv.cli", "serve", "--port", str(port), "--mode", mode,
               "--nvme-dir", str(store), *(f"--{k.replace('_', '-')}={v}" for k, v in BUDGETS.items())]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url = _wait(server, port)
            served_first = _ttft(url, text, QUESTIONS[0])
            pairs = [(_first_piece(session, QUESTIONS[1]), _ttft(url, text, QUESTIONS[1])) for _ in range(tries)]
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=120)
    answer = pairs[0][0][1]
    inproc = {"document_tokens": tokens, "prefill_s": session.document_s, "ttft_first_s": first.ttft_s,
              "ttft_second_s": statistics.median(p[0][0] for p in pairs), "reused_second": answer.reused_tokens,
              "prompt_second": answer.prompt_tokens}
    served = {"ttft_first_s": served_first[0], "ttft_second_s": statistics.median(p[1][0] for p in pairs),
              "cached_second": pairs[0][1][1]}
    return inproc, served


def _first_piece(session: Session, question: str, *, max_new_tokens: int = 8, pieces: int = 8):
    """Seconds from the call to the first piece of text (as a client of the server sees it), and the answer
    (its first ``pieces`` pieces: the stream is closed there)."""
    start = time.perf_counter()
    stream = session.ask(question, stream=True, max_new_tokens=max_new_tokens)
    first = None
    for n, _ in enumerate(stream, 1):
        first = time.perf_counter() - start if first is None else first
        if n == pieces:
            break
    stream.close()
    return first, stream.answer


def measure_past_window(report: Report, loaded, tokens: int, tries: int) -> None:
    """A document read dense, then a question whose answer may pass the window: its TTFT, against a sparse
    prefill of the same document and the question after it (what that question cost before). In turn."""
    text, window = document(loaded.tokenizer, tokens), loaded.spec.max_position
    progress(f"past the window: a {tokens}-token document read dense, then sparse prefills of it, in turn")
    seeded, prefilled = [], []
    for _ in range(tries):
        with Session(SessionConfig.of(model="smollm2", mode="auto", **BUDGETS), loaded=loaded) as session:
            n = session.read(text)
            ttft, answer = _first_piece(session, QUESTIONS[0], max_new_tokens=PAST_ANSWER)
            seeded.append((ttft, answer, session.document_s))
        with Session(SessionConfig.of(model="smollm2", mode="sparse", **BUDGETS), loaded=loaded) as session:
            session.read(text)
            ttft, answer = _first_piece(session, QUESTIONS[0], max_new_tokens=PAST_ANSWER)
            prefilled.append((session.document_s + ttft, answer, session.document_s))
    if answer.prompt_tokens + PAST_ANSWER <= window or seeded[0][1].mode != "sparse":
        raise SystemExit(f"the question does not pass the {window}-token window: {answer.prompt_tokens} prompt tokens")
    s, p = statistics.median(t for t, _, _ in seeded), statistics.median(t for t, _, _ in prefilled)
    config = f"auto@{n}"
    report.add_row(config, "document_dense_prefill_s", round(statistics.median(x[2] for x in seeded), 2), "s",
                   tokens=n)
    report.add_row(config, "ttft_past_window_s", round(s, 3), "s", reused=seeded[0][1].reused_tokens,
                   prompt=seeded[0][1].prompt_tokens, mode=seeded[0][1].mode)
    report.add_row(f"sparse@{n}", "document_sparse_prefill_s", round(statistics.median(x[2] for x in prefilled), 2),
                   "s", tokens=n)
    report.add_row(f"sparse@{n}", "prefill_and_ttft_s", round(p, 3), "s")
    agree = sum(a == b for a, b in zip(seeded[0][1].tokens, prefilled[0][1].tokens))
    report.add_ratio("ttft_past_window_vs_sparse_prefill", round(s / p, 4), None,
                     "auto: TTFT of a question past the window after a dense read / a sparse prefill of the document "
                     "and the question's TTFT after it, medians, same run", ceiling=True)
    report.add_bound(f"past the window: the question's first {len(seeded[0][1].tokens)} tokens agree with those after "
                     f"a sparse prefill at {agree} positions (greedy; the document's keys read back through RoPE's "
                     "inverse, in the model's dtype)")


def _ttft(url: str, text: str, question: str) -> tuple[float, int]:
    body = {"model": "smollm2", "stream": True, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}, {"role": "user", "content": question}]}
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first if first is not None else time.perf_counter() - start, cached


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(server: subprocess.Popen, port: int) -> str:
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tierkv serve exited: {server.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("tierkv serve did not start")


def measure(report: Report, loaded, mode: str, ctx: int, scratch: Path, tries: int) -> None:
    label = f"{ctx // 1024}K"
    text, store = document(loaded.tokenizer, ctx), scratch / f"{mode}-{label}"
    progress(f"{mode} {label}: session, then a server beside it")
    s, h = measure_both(loaded, text, mode, store, tries)
    config = f"{mode}@{label}"
    report.add_row(config, "document_prefill_s", round(s["prefill_s"], 2), "s", tokens=s["document_tokens"])
    report.add_row(config, "ttft_first_question_s", round(s["ttft_first_s"], 3), "s")
    report.add_row(config, "ttft_second_question_s", round(s["ttft_second_s"], 3), "s",
                   reused=s["reused_second"], prompt=s["prompt_second"])
    report.add_row(f"serve {config}", "ttft_first_question_s", round(h["ttft_first_s"], 3), "s")
    report.add_row(f"serve {config}", "ttft_second_question_s", round(h["ttft_second_s"], 3), "s",
                   reused=h["cached_second"])
    name = f"ttft_question_vs_prefill@{label}"
    report.add_ratio(name, round(s["ttft_second_s"] / (s["prefill_s"] + s["ttft_first_s"]), 4), TARGETS.get(name),
                     f"{mode}: TTFT of a second question / the document's first prefill and first TTFT, same "
                     "run", ceiling=True)
    report.add_ratio(f"serve_overhead@{label}", round(h["ttft_second_s"] / s["ttft_second_s"], 3),
                     TARGETS["serve_overhead"], f"{mode}: the server's TTFT of the second question, measured by "
                     "an HTTP client / the session's, same document held in memory, medians of turns taken in "
                     "turn", ceiling=True)
    report.add_bound(f"{config}: the second question computes {s['prompt_second'] - s['reused_second']} of its "
                     f"{s['prompt_second']} prompt tokens (dense: the document's partial last block and the "
                     "question; sparse: the question), then one decode step")


def progress(text: str) -> None:
    print(f"[reuse] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help)
    p.add_argument("--quick", action="store_true", help="dense 4K and sparse 12K (about 10 minutes on 2 cores)")
    p.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    p.add_argument("--dense", default=None, help="dense contexts in K tokens (default 8; quick 4; '': none)")
    p.add_argument("--sparse", default=None, help="sparse contexts in K tokens (default 32; quick 12; '': none)")
    p.add_argument("--tries", type=whole(1), default=5,
                   help="second questions asked of each, in turn (their median counts)")
    p.add_argument("--past", type=whole(0), default=None, metavar="TOKENS",
                   help="the document read dense before a question past the window (default: 512 tokens inside "
                        "the window; 0: not measured)")
    args = p.parse_args(argv)
    stop_on_sigterm()
    given = {"dense": args.dense, "sparse": args.sparse}
    default = {"dense": "4" if args.quick else "8", "sparse": "12" if args.quick else "32"}
    dense, sparse = ([int(x) * 1024 for x in (default[m] if given[m] is None else given[m]).split(",") if x]
                     for m in ("dense", "sparse"))
    start, scratch = time.perf_counter(), Path(tempfile.mkdtemp(prefix="tierkv-bench-reuse-"))
    report = Report("reuse", args.quick, machine(scratch))
    try:
        loaded = load_model("smollm2")
        past = loaded.spec.max_position - 512 if args.past is None else args.past
        if past >= loaded.spec.max_position - 64:
            raise SystemExit(f"--past {past}: the document and its question must fit the model's "
                             f"{loaded.spec.max_position}-token window, to be read dense")
        for mode, contexts in (("dense", dense), ("sparse", sparse)):
            for ctx in contexts:
                measure(report, loaded, mode, ctx, scratch, args.tries)
        if past:
            measure_past_window(report, loaded, past, min(args.tries, 3))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report.finish(start, args.out)


if __name__ == "__main__":
    main()
