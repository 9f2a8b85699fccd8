"""The ``tierkv`` command: one sub-command per user job, registered in COMMANDS.

An error prints one line, no traceback. The exit status says whose it is: 2, the command is
wrong (a bad flag or size, a budget too small for the work, a missing or unreadable file named on
it, a store directory that cannot be used); 1, the run failed (a full disk, a device error, a
damaged block); 130, interrupted; 143, terminated.
"""
from __future__ import annotations

import os

# Idle OpenMP workers spin by default; on a small machine that starves the I/O and event-loop
# threads the compute waits on (measured: a reused 4K prompt's recomputed chunk took 6-9 s of CPU
# instead of 3.7 s). Must be set before torch loads; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import errno
import json
import logging
import re
import select
import signal
import sys
import threading
from collections.abc import Callable

from tierkv.sizes import format_size
from tierkv.errors import BudgetExceeded, ConfigError, TierKVError
from tierkv.flags import add_flags, as_flag, build, check_not_read, given, nest, path_arg
from tierkv.knobs import IOKnobs
from tierkv.info import add_info
from tierkv.profile.command import add_profile
from tierkv.tune.tune import add_tune
from tierkv.schedule.command import add_batch
from tierkv.serve.command import add_serve
from tierkv.session.chat import add_chat
from tierkv.session.store_command import add_store


class UsageError(ConfigError):
    """A command-line mistake: reported in one line, exit status 2."""


RETIRED_FLAGS = {"--sparse-overlap": "overlap is the default; --no-sparse-overlap turns it off"}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A value such as -1GiB is the flag's value, shown to its own check ("expected a size"), not an
        # unknown flag that leaves the one before it "expected one argument". No flag starts with -<digit>.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but an unknown flag is named by the (sub)command it was given to, whose
        ``--help`` lists the flags it takes."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self._chosen(parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost (sub)command parser ``parsed`` went through."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None))
                if isinstance(chosen, _Parser):
                    return chosen._chosen(parsed)
        return self

    def error(self, message: str) -> None:  # one line, not usage + traceback
        hints = [f"{flag}: {why}" for flag, why in RETIRED_FLAGS.items()
                 if message.startswith("unrecognized arguments") and flag in message.split()]
        raise UsageError(f"{self.prog}: {message}{''.join(f'; {h}' for h in hints)} (see {self.prog} --help)")


# -- tierkv run --------------------------------------------------------------
def add_run(sub: argparse._SubParsersAction) -> None:
    from tierkv.model.settings import RunConfig
    p = sub.add_parser("run", help="run a model over a long document with its KV spilled across tiers",
                       description="Prefill a long prompt chunk by chunk with the KV in gpu/cpu/NVMe tiers, "
                                   "then generate. A second run over the same document reuses the stored KV.")
    add_flags(p, RunConfig)
    p.add_argument("--config", type=path_arg, help="settings file written by `tierkv tune` (flags given here win)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.set_defaults(func=cmd_run)


def run_config(args: argparse.Namespace):
    """The run's settings: each field's default, then ``--config``'s values, then the flags given."""
    from tierkv.model.settings import RunConfig, mode_flags, mode_settings
    from tierkv.tune.tune import read_run_config
    in_file = read_run_config(args.config) if args.config else {}
    config = build(RunConfig, nest(RunConfig, in_file), given(args, RunConfig))
    sparse_given, dense_given = mode_flags(args)
    sparse_filed, dense_filed = mode_settings(in_file)       # (a tuned config's prefetcher is one mode's)
    sparse_given += [f"{flag} (in --config {args.config})" for flag in sparse_filed]
    dense_given += [f"{flag} (in --config {args.config})" for flag in dense_filed]
    config.engine.check_flags(sparse_given, dense_given)
    check_not_read({"--trace": config.output.trace, "--record-access": config.output.record_access},
                   {"--config": args.config})
    return config, sparse_given, dense_given


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from tierkv.session.run import run
    config, sparse_given, dense_given = run_config(args)
    bars: list[tqdm] = []

    def on_prefill(done: int, total: int) -> None:
        if not bars:      # (what came before the bar, found stored or a first chunk, counts in no rate)
            bars.append(tqdm(total=total, initial=done, unit="tok", desc="prefill", file=sys.stderr,
                             dynamic_ncols=True))
        bars[0].update(done - bars[0].n)
        if done >= total:
            bars[0].close()  # before the answer streams out

    def on_text(piece: str) -> None:
        if not args.json:
            print(piece, end="", flush=True)

    def on_question(i: int, question: str) -> None:
        if not args.json and len(config.prompt.questions) > 1:
            print(f"{chr(10) if i else ''}[{i + 1}] {question}", flush=True)

    try:
        with logging_redirect_tqdm():            # a warning (a damaged block recomputed) above the bar, not in it
            result = run(config, on_text=on_text, on_prefill=on_prefill, on_question=on_question)
    finally:
        for bar in bars:
            bar.close()
    notes = []
    if sparse_given and result.mode != "sparse":
        notes.append(f"{', '.join(sparse_given)} unused: --mode auto ran dense, the prompt and its answer being "
                     "within the model's trained window; --mode sparse applies them")
    if dense_given and result.mode == "sparse":
        notes.append(f"{', '.join(dense_given)} unused: --mode auto ran sparse, the prompt and its answer passing "
                     "the model's trained window (--page-dtype quantizes sparse pages)")
    if args.json:
        print(json.dumps(result.as_dict() | ({"notes": notes} if notes else {}), indent=2))
    else:
        print()
        _print_run_summary(result, config)
        for note in notes:
            print(f"note: {note}")
    return 0


def _print_run_summary(r, config) -> None:
    stored = f", blocks stored as {r.kv_dtype}" if r.kv_dtype else ""
    print(f"\nprompt {r.prompt_tokens} tokens (KV {format_size(r.kv_bytes)} in {r.dtype}{stored}), reused "
          f"{r.reused_prompt_tokens}; "
          f"document read in {r.prefill_s:.1f} s, first token after {r.ttft_s:.1f} s")
    for i, a in enumerate(r.answers[1:], 2):
        print(f"question {i}: prompt {a['prompt_tokens']} tokens, reused {a['reused_prompt_tokens']}, "
              f"first token after {a['ttft_s']:.2f} s")
    if r.decode_tokens_per_s:
        print(f"decode {r.generated_tokens} tokens at {r.decode_tokens_per_s:.2f} tok/s, "
              f"stall {100 * r.stall_fraction:.1f} % of decode time")
    else:                            # (each answer's one token came from its prompt's pass)
        print(f"decode: no step ({r.generated_tokens} token(s), each from its prompt's pass)")
    drafted = sum(a["drafted_tokens"] for a in r.answers)
    if drafted:
        accepted = sum(a["accepted_tokens"] for a in r.answers)
        print(f"drafts: {accepted} of {drafted} drafted tokens accepted ({100 * accepted / drafted:.0f} %)")
    if r.mode == "sparse":
        _print_sparse_summary(r.sparse)
    if r.answer is not None:
        print(f"passkey {r.answer}: {'found' if r.found else 'NOT found'} in the output")
    print(f"{'tier':6s} {'budget':>10s} {'peak':>10s} {'final':>10s} {'read':>10s} {'written':>10s} {'policy':>8s}  "
          "backend")
    for name, t in r.tiers.items():
        print(f"{name:6s} {format_size(t['budget_bytes']):>10s} {format_size(t['peak_bytes']):>10s} "
              f"{format_size(t['final_bytes']):>10s} {format_size(t['bytes_read']):>10s} "
              f"{format_size(t['bytes_written']):>10s} {t['policy']:>8s}  {t['backend']}")
    if r.buffers is not None and r.buffers["budget_bytes"]:
        b = r.buffers
        print(f"{'buffer':6s} {format_size(b['budget_bytes']):>10s} {format_size(b['peak_bytes']):>10s} "
              f"{format_size(b['final_bytes']):>10s} {'-':>10s} {'-':>10s} {'-':>8s}  each layer's K/V as one "
              f"tensor, {b['device']} (--kv-buffer)")
    if r.remote is not None:
        _print_remote(r.remote)
    if config.output.trace:
        trace = config.output.trace
        print(f"trace written to {trace}: open it in ui.perfetto.dev, or `tierkv profile {trace}`")


def _print_remote(m: dict) -> None:
    problems = [f"{m[k]} {what}" for k, what in (("corrupt", "failed their checksum (recomputed)"),
                                                 ("skipped", "writes skipped"), ("slower", "not read: "
                                                 "recomputing was faster"), ("errors", "errors")) if m[k]]
    last = f" (last: {m['last_error']})" if m["last_error"] else ""
    print(f"remote {m['url']}: read {m['hits']} blocks ({format_size(m['read_bytes'])}), {m['misses']} not there; "
          f"wrote {m['written']} ({format_size(m['write_bytes'])})" + "".join(f"; {p}" for p in problems) + last)


def _print_sparse_summary(s: dict) -> None:
    lo, hi = min(s["layer_tokens"], default=0), max(s["layer_tokens"], default=0)
    spread = f" ({lo}-{hi} by layer in the last step, {s['allocation']})" if lo != hi else ""
    print(f"sparse: {s['budget_tokens']} tokens per KV head{spread} by {s['selector']}, rank {s['rank']}, "
          f"positions {s['positions']}, prefetch {s['prefetch']}{', overlap' if s['overlap'] else ''}; "
          f"{s['tokens_per_layer_step']:.0f} tokens "
          f"attended per layer beside sinks and window (attend {s['attend']}); pages reused from the previous step "
          f"{100 * s['reuse_rate']:.0f} %; pages of {s['page_tokens']} tokens in {s['page_dtype']} "
          f"({format_size(s['page_bytes'])}), landmarks {s['landmark_dtype']}; index in memory "
          f"{format_size(s['index_bytes'])}")
    if s["resumed_prefill_tokens"]:
        print(f"resumed a stopped prefill at token {s['resumed_prefill_tokens']}; its prefill took "
              f"{s['prefill_s_all_runs']:.0f} s over all runs")
    for r in s["repairs"]:
        print(f"repaired {r['pages']} lost or damaged page(s) of the stored document: replayed {r['tokens']} tokens "
              f"from token {r['start']} in {r['seconds']:.1f} s ({r['scrubbed']} pages checked in "
              f"{r['scrub_s']:.1f} s)")
    if s["approximate_prefill"]:
        print(f"note: prefill was exact for the first {s['dense_prefill_tokens']} tokens and sparse after "
              f"(an approximation; --dense-prefill-tokens N prefills more exactly, at quadratic cost)")


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_info, add_run, add_chat, add_serve, add_store,
                                                                add_profile, add_tune, add_batch]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tierkv", description="Tiered KV-cache offloading runtime for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: what is open closes as for Ctrl-C (stores flushed, a batch's
    scratch removed), where the signal's default would end the process on the spot."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    before = signal.signal(signal.SIGTERM, _terminated)   # (tierkv serve's server puts its own in while it runs)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, before)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        IOKnobs.from_env().apply_to_process()   # this process is tierkv's own
        if args.command != "serve":             # (the server's log lines carry times: its own format)
            logging.basicConfig(level=logging.WARNING, format="tierkv: %(message)s")
        status = args.func(args)
        sys.stdout.flush()                      # (a reader gone shows here, not in the exit's flush)
        return status
    except BrokenPipeError as error:
        if not _stdout_gone():
            print(f"tierkv: error: {error}", file=sys.stderr)
            return 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())    # (the exit's flush would fail too)
        return 128 + signal.SIGPIPE          # as a command killed by SIGPIPE: `tierkv ... | head` is no error
    except (TierKVError, OSError) as error:
        print(f"tierkv: error: {as_flag(str(error), parser)}", file=sys.stderr)
        return 2 if _usage(error) else 1
    except Terminated:
        print("tierkv: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("tierkv: interrupted", file=sys.stderr)
        return 130


def _stdout_gone() -> bool:
    """Whether standard output is a pipe nobody reads any more (its reader exited)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _usage(error: BaseException) -> bool:
    """Whether ``error`` is the command's fault (exit 2), not the run's (exit 1)."""
    return isinstance(error, (ConfigError, BudgetExceeded)) or (isinstance(error, OSError) and not isinstance(error, TierKVError)
                                              and error.errno in _USAGE_ERRNOS)


_USAGE_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                 errno.ELOOP}


if __name__ == "__main__":
    sys.exit(main())
