"""``tierkv chat --doc FILE``: a conversation in the terminal about a document read once.

    > Who wrote it?                 answers stream as they are generated
    > /stats                        the last answer: prompt, reused tokens, first token, tok/s, stall; tiers
    > /reset                        a new conversation about the same document (nothing recomputed)
    > /quit                         (or Ctrl-D; Ctrl-C stops an answer, and at the prompt leaves)

Each turn goes on from the state the previous one left (the document, the questions and
answers so far), so only the new question is computed. History is kept in
``$TIERKV_CACHE_DIR/chat_history`` (arrow keys recall earlier questions).
"""
from __future__ import annotations

import argparse
import io
import signal
import sys
import threading
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.flags import add_flags, build, given, path_arg
from tierkv.knobs import cache_dir
from tierkv.model.prompt import read_document
from tierkv.model.settings import SessionConfig, mode_flags
from tierkv.sizes import format_size
from tierkv.session.generation import Answer, Sampling
from tierkv.session.inputs import check_text
from tierkv.session.session import Cancelled, Session

HELP = "commands: /stats (the last answer and the tiers), /reset (a new conversation), /help, /quit"


def add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="talk about a document in the terminal; it is read once",
                       description="Read a document once (or find it stored), then answer question after "
                                   f"question, each turn reusing the last. {HELP}.")
    p.add_argument("--doc", type=path_arg, help="the document (a text file); without it, a plain chat")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="tokens per answer at most (256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampled")
    p.add_argument("--no-history", action="store_true",
                   help="keep no question in $TIERKV_CACHE_DIR/chat_history (kept by default, for the arrow keys)")
    add_flags(p, SessionConfig)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    config = build(SessionConfig, given(args, SessionConfig))
    config.engine.check_flags(*mode_flags(args))
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    Sampling.of(sampling)           # checked before the model loads, not at the first question
    text = read_document(args.doc) if args.doc is not None else None
    if not args.no_history:
        _history()
    if isinstance(sys.stdin, io.TextIOWrapper):    # bytes that are not UTF-8 reach check_text, named there (a
        sys.stdin.reconfigure(errors="surrogateescape")   # strict decoder raises, and drops the lines after them)
    print(f"loading {config.engine.model} ...", file=sys.stderr, flush=True)
    with Session(config) as session:
        if text is not None:
            print(f"reading {args.doc} ...", file=sys.stderr, flush=True)
            tokens = session.read_text(text)
            print(f"{tokens} tokens ({session.document_reused} found stored) in {session.document_s:.1f} s. {HELP}",
                  file=sys.stderr)
        _converse(session, text, sampling)
    return 0


def _converse(session: Session, text: str | None, sampling: dict) -> None:
    start = [{"role": "user", "content": text}] if text is not None else []
    messages, last = list(start), None
    while (line := _ask()) is not None:
        command = line.strip()
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":
            messages, last = list(start), None
            print("(a new conversation)")
        elif command == "/stats":
            _stats(session, last)
        elif command == "/help":
            print(HELP)
        elif command.startswith("/"):
            print(f"unknown command {command.split()[0]}; {HELP}")
        elif line.strip():
            try:
                check_text(line, "the question")
            except ConfigError as error:
                print(f"({error}; ask again)")
                continue
            messages.append({"role": "user", "content": line})
            answer = _answer(session, messages, sampling)
            if answer is None:                  # stopped before its first token: as if not asked
                messages.pop()
            else:
                last = answer
                messages.append({"role": "assistant", "content": last.text})


def _answer(session: Session, messages: list, sampling: dict) -> Answer | None:
    """The reply to ``messages``, streamed; Ctrl-C stops it (what came so far is the answer; None before its
    first token) and the conversation goes on: Ctrl-C at the prompt, or Ctrl-D, leaves."""
    stop = threading.Event()
    before = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        stream = session.chat(messages, stream=True, cancelled=stop.is_set, **sampling)
        for piece in stream:
            print(piece, end="", flush=True)
    except Cancelled:
        print("(stopped)")
        return None
    finally:
        signal.signal(signal.SIGINT, before)
    print(" (stopped)" if stream.answer.finish_reason == "cancelled" else "")
    return stream.answer


def _ask() -> str | None:
    try:
        return input("> ")
    except EOFError:
        print()
        return None


def _stats(session: Session, answer: Answer | None) -> None:
    if answer is None:
        print("nothing asked yet")
        return
    print(f"prompt {answer.prompt_tokens} tokens, {answer.reused_tokens} reused; first token after "
          f"{answer.ttft_s:.2f} s; {answer.generated_tokens} tokens at {answer.decode_tokens_per_s:.2f} tok/s, "
          f"stall {100 * answer.stall_fraction:.1f} %")
    for mode, backend in session.backends.items():
        for tier, row in backend.tier_report().items():
            print(f"  {mode:6s} {tier:5s} {format_size(row['final_bytes']):>10s} of {format_size(row['budget_bytes'])}")


def _history() -> None:
    """Arrow keys recall earlier questions, across runs (where readline exists)."""
    try:
        import atexit
        import readline
    except ImportError:
        return
    path = cache_dir() / "chat_history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.read_history_file(path)
    except OSError:
        pass
    atexit.register(lambda: _save_history(readline, path))


def _save_history(readline, path: Path) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass
