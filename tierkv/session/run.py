"""One ``tierkv run``: a session reads the document (or a synthetic passkey haystack), answers each
question, and reports what it cost: times, reuse, stall share, and per tier its budget, peak and
final bytes, bytes read and written, and the backend that moved them.

    read     the document's prefix state: found stored (reused) or prefilled, and stored
    ask      each question on a fork of it: only the question's tokens are computed
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.events import Event, EventKind
from tierkv.model.loading import LoadedModel
from tierkv.model.prompt import DEFAULT_QUESTION, passkey_prompt, read_document
from tierkv.model.settings import OutputSettings, RunConfig
from tierkv.profile.probe import cached_links
from tierkv.profile.trace import write_trace
from tierkv.session.backend import Backend
from tierkv.session.generation import Answer
from tierkv.session.session import Session

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunResult:
    text: str = ""                      # the first answer
    prompt_tokens: int = 0              # of the first question's prompt
    document_tokens: int = 0
    generated_tokens: int = 0           # all answers
    prefill_s: float = 0.0              # reading the document
    ttft_s: float = 0.0                 # from the start to the first answer's first token
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    stall_fraction: float = 0.0
    reused_prompt_tokens: int = 0       # of the first question's prompt, found stored
    mode: str = "dense"
    kv_bytes: int = 0
    dtype: str = ""                     # the compute dtype: KV as computed
    kv_dtype: str | None = None         # dense mode: how sealed blocks are stored (--kv-dtype; None: as computed)
    answers: list[dict[str, object]] = field(default_factory=list)   # one per question
    sparse: dict[str, object] = field(default_factory=dict)
    answer: str | None = None           # the planted passkey of a synthetic prompt
    found: bool | None = None
    # per tier: budget, peak, bytes read and written over the run; answer_bytes_read: read after the prefill
    tiers: dict[str, dict[str, object]] = field(default_factory=dict)
    remote: dict[str, object] | None = None   # the remote store's counts (--remote)
    buffers: dict[str, object] | None = None  # dense mode: the per-layer K/V buffers (--kv-buffer)

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


def run(config: RunConfig, *, on_text: Callable[[str], None] = lambda s: None,
        on_prefill: Callable[[int, int], None] = lambda done, total: None,
        on_question: Callable[[int, str], None] = lambda i, q: None,
        loaded: LoadedModel | None = None) -> RunResult:
    """``on_text``: each piece of an answer as it comes; ``on_question(i, question)`` before the
    i-th answer; ``on_prefill(done, total)``: prefill progress in tokens."""
    p = config.prompt
    if p.synthetic_tokens is not None and p.questions:
        raise ConfigError("--question asks about --doc; a synthetic prompt asks for its passkey")
    text = read_document(p.doc) if p.synthetic_tokens is None else None   # a bad --doc fails before the model loads
    out = config.output
    out.check_paths({"--doc": p.doc})
    with Session(config.session(), loaded=loaded, keep_events=out.trace is not None,
                 record_access=out.record_access is not None) as session:
        try:
            result, backend = _ask_all(session, config, text, on_text, on_prefill, on_question)
        except BaseException as error:        # (Ctrl-C, a failure): what was recorded so far, said to be partial
            _write_partial(session, out, error)
            raise
        _write_outputs(session, backend, out, {"tiers": result.tiers} | _links_meta(config.tiers.nvme_dir))
    return result


def _ask_all(session: Session, config: RunConfig, text: str | None, on_text: Callable[[str], None],
             on_prefill: Callable[[int, int], None],
             on_question: Callable[[int, str], None]) -> tuple[RunResult, Backend]:
    """The document read, each question answered, and the figures: the run's result, and the backend
    that answered last."""
    p, out = config.prompt, config.output
    tokenizer, start = session.loaded.tokenizer, time.perf_counter()
    prompt = passkey_prompt(tokenizer, p.synthetic_tokens, **p.haystack()) \
        if p.synthetic_tokens is not None else None
    result = RunResult(answer=None if prompt is None else prompt.answer)
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        on_prefill(done[0], result.document_tokens)

    if prompt is None:
        result.document_tokens = len(session.document_ids(text))
        session.read_text(text, progress=progress)
    else:
        result.document_tokens = len(prompt.ids) - 1
        session.read_ids(prompt.ids[:-1], progress=progress)
    result.prefill_s = session.document_s
    document = session.backend(session.document.mode)
    before = {name: stats["bytes_read"] for name, stats in document.manager.tier_stats().items()}
    read_at = start + (time.perf_counter() - start - session.document_s)
    questions = list(p.questions or [DEFAULT_QUESTION]) if prompt is None else [None]
    for i, question in enumerate(questions):
        on_question(i, question or "")
        stream = session.ask(question, stream=True, max_new_tokens=out.max_new_tokens) if prompt is None \
            else session.complete(prompt.ids, stream=True, max_new_tokens=out.max_new_tokens)
        for piece in stream:
            on_text(piece)
        _add_answer(result, question, stream.answer, start if i == 0 else None, session.document_reused)
    backend = session.backends[session.last_mode]
    # the document's read, on the time line of the trace: it starts where the answering backend was made
    done_at, read_at = read_at + result.prefill_s, max(read_at, backend.events.origin)
    if done_at > read_at:
        backend.events.record(Event(EventKind.PREFILL, "", "", None, 0, read_at, read_at, done_at))
    _summarise(result, backend, session)
    prefill_reads = before if backend is document else {}
    for name, stats in result.tiers.items():    # what the answers read, the document's prefill aside
        stats["answer_bytes_read"] = stats["bytes_read"] - prefill_reads.get(name, 0)
    if prompt is not None:
        result.found = prompt.answer in result.text
    backend.manager.flush()
    return result, backend


def _write_partial(session: Session, out: OutputSettings, error: BaseException) -> None:
    try:
        _write_outputs(session, None, out, {"partial": _stopped_by(error)})
    except Exception as failed:               # (the run's own error is the one to raise)
        log.warning("the run stopped, and what it recorded could not be written: %s", failed)


def _write_outputs(session: Session, backend: Backend | None, out: OutputSettings, meta: dict) -> None:
    """The run's trace and access trace, of ``backend`` (None: the backend that ran last, or the one that read
    the document: a run that stopped). A stopped run that recorded nothing leaves no file of an earlier
    run where it was to write one."""
    backend = backend or session.backends.get(session.last_mode) or next(iter(session.backends.values()), None)
    if backend is None or "partial" in meta and out.trace is not None and not backend.events.events:
        for path in (out.trace, out.record_access):
            if path is not None:
                Path(path).unlink(missing_ok=True)
        return
    if out.record_access is not None:
        backend.access.save(out.record_access, backend.manager.manager)
    if out.trace is not None:
        events = backend.events
        write_trace(out.trace, events.events, events.origin, meta={"block_bytes": backend.layout.block_bytes} | meta)
    written = [str(p) for p in (out.trace, out.record_access) if p is not None]
    if "partial" in meta and written:            # (no file asked for: nothing to say)
        log.warning("the run stopped (%s): %s %s what it did until then", meta["partial"], " and ".join(written),
                    "hold" if len(written) > 1 else "holds")


def _links_meta(nvme_dir: Path | None) -> dict:
    """The links ``tierkv info --probe`` measured on this machine, for the trace (where it did)."""
    links = cached_links(nvme_dir)
    return {} if links is None else {"links": links["links"], "links_measured_at": links["measured_at"]}


def _stopped_by(error: BaseException) -> str:
    return "interrupted" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"


def _add_answer(result: RunResult, question: str | None, answer: Answer, start: float | None,
                document_reused: int) -> None:
    entry = {"question": question, "text": answer.text, "prompt_tokens": answer.prompt_tokens,
             "reused_prompt_tokens": answer.reused_tokens, "ttft_s": answer.ttft_s,
             "generated_tokens": answer.generated_tokens, "decode_tokens_per_s": answer.decode_tokens_per_s,
             "stall_fraction": answer.stall_fraction, "finish_reason": answer.finish_reason,
             "drafted_tokens": answer.drafted, "accepted_tokens": answer.accepted}
    if start is not None:      # the first answer waited for the document, which earlier runs may have stored
        result.text, result.prompt_tokens = answer.text, answer.prompt_tokens
        result.reused_prompt_tokens = entry["reused_prompt_tokens"] = document_reused
        result.ttft_s = entry["ttft_s"] = result.prefill_s + answer.ttft_s
    result.answers.append(entry)
    result.generated_tokens += answer.generated_tokens
    result.decode_s += answer.decode_s
    result.stall_fraction += answer.stall_s       # seconds until _summarise divides
    result.sparse = answer.report


def _summarise(result: RunResult, backend, session: Session) -> None:
    steps = result.generated_tokens - len(result.answers)
    result.decode_tokens_per_s = steps / result.decode_s if steps > 0 and result.decode_s else 0.0
    result.stall_fraction = result.stall_fraction / result.decode_s if result.decode_s else 0.0
    result.mode = backend.mode
    spec = session.loaded.spec
    result.kv_bytes = result.prompt_tokens * spec.kv_bytes_per_token     # the prompt's, as the summary says
    result.dtype = str(spec.dtype).removeprefix("torch.")
    result.kv_dtype = session.config.engine.kv_dtype if backend.mode == "dense" else None
    tiers = session.config.tiers
    policies = {"gpu": tiers.gpu_policy, "cpu": tiers.cpu_policy, "nvme": tiers.nvme_policy}
    result.tiers = {name: {**stats, "policy": policies.get(name, "lru")}
                    for name, stats in backend.tier_report().items()}
    result.remote = backend.remote_report()
    result.buffers = backend.buffer_report()
