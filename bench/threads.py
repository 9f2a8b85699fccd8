"""Threads sharing one session: answers side by side against the same answers one after another.

A real-text document (``reuse.document``, CPython's own documentation) is read once; then, per round,
the questions are asked one after another, and again from one thread each at once (prompts are
computed one at a time, answers decode side by side: ``tierkv.session``). Greedy, so both give the
same tokens, which the bench checks::

    side_by_side_vs_one_after_another   generated tokens a second, all threads together / the same
                                        answers asked in turn (the better round of each)

    python bench/threads.py --out bench/out/threads.json
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # as under the tierkv command (tierkv.cli)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from report import Help, Report, machine, out_file, stop_on_sigterm, whole  # noqa: E402
from reuse import document  # noqa: E402
from tierkv.session import Session  # noqa: E402

QUESTIONS = ("What is this document about?", "Name one keyword the document explains.",
             "Which statement ends a loop?", "What does the pass statement do?", "What is a nonlocal name?",
             "How is an exception raised?", "What does import do?", "When does a while loop stop?")


def one_after_another(session: Session, questions: list[str], tokens: int) -> tuple[float, list]:
    began = time.perf_counter()
    answers = [session.ask(q, max_new_tokens=tokens) for q in questions]
    return time.perf_counter() - began, answers


def side_by_side(session: Session, questions: list[str], tokens: int) -> tuple[float, list]:
    answers: list = [None] * len(questions)
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            answers[i] = session.ask(questions[i], max_new_tokens=tokens)
        except BaseException as error:       # noqa: BLE001 - raised on the main thread below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began, answers


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=Help,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--threads", type=whole(2), default=4, help=f"questions asked at once (at most "
                        f"{len(QUESTIONS)})")
    parser.add_argument("--tokens", type=whole(1), default=32, help="new tokens an answer at most")
    parser.add_argument("--context", type=whole(64), default=2048, help="the document's tokens, about")
    parser.add_argument("--rounds", type=whole(1), default=2, help="rounds of both ways (the better counts)")
    parser.add_argument("--mode", choices=("dense", "sparse"), default="dense", help="the session's mode")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="compute dtype")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    args = parser.parse_args(argv)
    if args.threads > len(QUESTIONS):
        parser.error(f"--threads {args.threads}: at most {len(QUESTIONS)} (the questions this bench has)")
    stop_on_sigterm()
    start = time.perf_counter()
    questions = list(QUESTIONS[:args.threads])
    with tempfile.TemporaryDirectory(prefix="tierkv-threads-") as scratch:
        report = Report("threads", False, machine(scratch))
        with Session.open("smollm2", nvme_dir=Path(scratch) / "store", mode=args.mode, dtype=args.dtype) as session:
            session.read(document(session.loaded.tokenizer, args.context))
            session.ask(questions[0], max_new_tokens=2)                     # warm-up, untimed
            alone, together = [], []
            for _ in range(args.rounds):
                alone.append(one_after_another(session, questions, args.tokens))
                together.append(side_by_side(session, questions, args.tokens))
            dtype = str(session.loaded.model.dtype).removeprefix("torch.")
    same = all([a.tokens for a in x[1]] == [a.tokens for a in y[1]] for x, y in zip(alone, together))
    for config, runs in (("one-after-another", alone), ("side-by-side", together)):
        seconds, answers = min(runs, key=lambda run: run[0])
        generated = sum(a.generated_tokens for a in answers)
        report.add_row(config, "tokens_per_s", round(generated / seconds, 2), "tok/s", threads=args.threads,
                       generated=generated, seconds=round(seconds, 3), dtype=dtype, mode=args.mode,
                       ttft_median_s=round(statistics.median(a.ttft_s for a in answers), 3), same_tokens=same)
    report.add_ratio("side_by_side_vs_one_after_another",
                     round(report.rows[1]["value"] / report.rows[0]["value"], 3), None,
                     f"generated tok/s of {args.threads} answers from one thread each / asked in turn, one session")
    report.add_bound("prompts are computed one at a time (the session's lock); the decode steps of answers run "
                     "side by side on forks of their own, so one answer's Python overhead overlaps another's "
                     "compute; each step still reads every weight once an answer (no batching)")
    report.finish(start, args.out)
    if not same:
        print("threads: the answers side by side differ from those asked in turn", file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
