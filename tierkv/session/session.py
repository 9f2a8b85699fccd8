"""A session: read a long document once, then ask, chat and complete over it as often as you like.

    with Session.open("smollm2", nvme_dir="/mnt/nvme/kv", gpu_budget="2GiB") as s:
        s.read(Path("report.txt"))                 # prefilled once, or found stored (a str is the text itself)
        print(s.ask("What are the three main findings?").text)
        for piece in s.ask("Who wrote it?", stream=True):
            print(piece, end="")
        branch = s.fork()                          # the same document, a conversation of its own

Every request renders its prompt with the model's chat template and runs from the longest
state it can reuse: one this session holds (the document, recent conversations) or, with an
NVMe store, one any earlier run stored. The document is the first user message, each
question a later one: a template renders earlier messages the same whatever follows them, so
the document's tokens are a prefix of every question's prompt::

    prompt   [system][user: document .....................][user: question][assistant: ...
    state    [system][user: document .....................]      reused, never changed
    computed                                                [user: question]  then the answer

Dense mode reuses whole stored blocks; sparse mode the stored index of the prefix. The mode
is chosen per prompt (``EngineSettings.mode``: auto is sparse past the trained window); a sparse
prefix held dense (a question whose answer would pass the window) takes the dense KV, not computed again.
Threads may share a session and its forks: prompts are computed one request at a time, answers
decode side by side on forks of their own (each one's ``stall_s`` is its own thread's waits). A
``progress`` or ``cancelled`` function runs while its request holds the session: one that waits
for another thread's request on the same session waits for ever.
"""
from __future__ import annotations

import functools
import logging
import numbers
import sys
import threading
import time
from dataclasses import replace
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from tierkv.errors import BudgetExceeded, ConfigError, TierKVError
from tierkv.events import Event, EventKind
from tierkv.model.loading import LoadedModel, load_model
from tierkv.model.prompt import chat_ids
from tierkv.model.settings import SessionConfig, as_setting, mode_settings
from tierkv.model.sparse_engine import SparseEngine
from tierkv.session.backend import Backend, open_backend
from tierkv.session.generation import Answer, Sampling, generate
from tierkv.session.inputs import (Message, check_length, check_text, document_text, document_token_ids,
                                   prompt_ids)
from tierkv.session.state import KVState, Progress, covers, fork_at
from tierkv.session.stream import Stream
from tierkv.tiers.nvme_share import prepare_store_dir

log = logging.getLogger(__name__)


class Cancelled(TierKVError):
    """The request's ``cancelled()`` came true while its prompt was computed; what it had computed
    is let go of (kept in the store where there is one)."""


Cancel = Callable[[], bool]


class Session:
    def __init__(self, config: SessionConfig = SessionConfig(), *, loaded: LoadedModel | None = None,
                 keep_events: bool = False, record_access: bool = False, max_states: int = 4,
                 max_prompt_tokens: int | None = None) -> None:
        """``keep_events``: keep every transfer event for a trace (else each answer's are dropped
        after it); ``max_states``: conversation states kept for their next turn;
        ``max_prompt_tokens``: longer prompts are refused (PromptTooLong) before any work."""
        if isinstance(max_states, bool) or not isinstance(max_states, numbers.Integral) or max_states < 0:
            raise ConfigError(f"max_states={max_states!r}: expected an integer >= 0 (0: keep no conversation state)")
        if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool) or
                                              not isinstance(max_prompt_tokens, numbers.Integral) or
                                              max_prompt_tokens < 1):
            raise ConfigError(f"max_prompt_tokens={max_prompt_tokens!r}: expected an integer >= 1, or None (no limit)")
        self.max_prompt_tokens = max_prompt_tokens
        self.config = config
        if config.tiers.nvme_dir is not None:    # a store that cannot be made fails now, not at the first question
            prepare_store_dir(config.tiers.nvme_dir)
        self.loaded = loaded or load_model(config.engine.model, dtype=config.engine.torch_dtype,
                                             weights=config.engine.weights)
        if config.engine.mode != "dense":        # a page format this model cannot store fails now, not at a read
            SparseEngine.page_layout(self.loaded, config.sparse)
        self.keep_events, self.record_access, self.max_states = keep_events, record_access, max_states
        self.backends: dict[str, Backend] = {}
        self.document: KVState | None = None            # what read() took in
        self.document_reused = 0
        self.document_s = 0.0
        self._states: list[KVState] = []                # conversations, newest last
        self.last_mode = ""                             # the mode of the last answer
        self._messages: list[Message] = []              # the document's messages
        self.closed = False
        self._opener: Session | None = None             # a fork's: the session whose backends it shares
        self._made_as = id(self)                        # the session that opened the backends (not a copy of it)
        # shared with its forks, as the backends are: one lock over choosing, making, keeping and letting go of states
        self._lock = threading.RLock()

    @classmethod
    def open(cls, model: str = "smollm2", *, loaded: LoadedModel | None = None, **settings: Any) -> Session:
        """A session over ``model``; ``settings`` named as ``tierkv run``'s flags (``nvme_dir``,
        ``gpu_budget``, ``cpu_budget``, ``mode``, ``dtype``, ``sparse_budget``, ...); those of the mode not
        chosen are refused, as the command line refuses them (``mode="dense", sparse_budget=64``)."""
        config = SessionConfig.of(model=model, **settings)
        config.engine.check_flags(*mode_settings(settings, as_flags=False), named=as_setting)
        return cls(config, loaded=loaded)

    # -- documents ----------------------------------------------------------------------------------
    def read(self, document: str | Path, *, progress: Progress | None = None) -> int:
        """Take in a document (a path, or the text itself): prefilled, or found stored. Later
        questions are asked about it. Returns its tokens."""
        return self.read_text(document_text(document), progress=progress)

    def read_text(self, text: str, *, progress: Progress | None = None) -> int:
        """``read`` of the document's text, whatever it looks like (a file's content read by the caller)."""
        if not text.strip():
            raise ConfigError("the document is empty")
        check_text(text, "the document")
        return self._take_in(self.document_ids(text), progress, [{"role": "user", "content": text}])

    def document_ids(self, text: str) -> list[int]:
        """The tokens ``read(text)`` takes in: the document as the first user message."""
        return chat_ids(self.loaded.tokenizer, [{"role": "user", "content": text}], generation=False)

    def read_ids(self, ids: Sequence[int], *, progress: Progress | None = None) -> int:
        """``read`` for token ids (a prompt built by hand). Prompts that start with them (``complete``,
        ``chat``) go on from their state; ``ask`` needs a document's text to put a question after."""
        return self._take_in(ids, progress, [])

    def _take_in(self, ids: Sequence[int], progress: Progress | None, messages: list[Message]) -> int:
        """The document's state made from ``ids`` (``messages``: the document's, for ``ask``). The one
        before is let go of first (the tiers may hold one of them, not both); where the new one fails,
        the session holds none, so that no question is asked of a document whose KV is gone."""
        self._check_open()
        ids = document_token_ids(ids, self.loaded.spec.vocab)
        start = time.perf_counter()
        with self._lock:
            old, self.document, self._messages, self.document_reused = self.document, None, [], 0
            if old is not None:
                old.release()
            self.document, self.document_reused = self._prefix_state(ids, progress)
            self._messages = messages
        self.document_s = time.perf_counter() - start
        return len(ids)

    # -- asking -------------------------------------------------------------------------------------
    def ask(self, question: str, *, stream: bool = False, cancelled: Cancel | None = None,
            **sampling: Any) -> Answer | Stream:
        """A question about the document ``read`` took in, seeing nothing asked before. ``cancelled``
        (of every request call): asked as the prompt is computed and at every token; once it is true
        the answer stops (``Cancelled`` while the prompt is computed, ``finish_reason`` "cancelled" after)."""
        self._check_open()
        if not isinstance(question, str) or not question.strip():
            raise ConfigError(f"question={question!r}: ask something (a non-empty string)")
        with self._lock:                 # (a document another thread is reading: asked of once it is in)
            if self.document is None:
                raise TierKVError("read a document first: session.read(Path(file)) or session.read(text)")
            if not self._messages:
                raise TierKVError("the document was read as token ids (read_ids), and ask() puts a question after "
                                  "a document's text: read(text) instead, or complete() a prompt that starts with "
                                  "the ids")
            messages = [*self._messages, {"role": "user", "content": question}]
        return self._chat(messages, stream, sampling, keep=False, cancelled=cancelled)

    def chat(self, messages: Sequence[Message], *, stream: bool = False, cancelled: Cancel | None = None,
             **sampling: Any) -> Answer | Stream:
        """The assistant's reply to ``messages`` (OpenAI-style dicts with role and content). The
        state after the reply is kept a while, so a next turn that repeats these messages and the
        reply goes on from it."""
        return self._chat(messages, stream, sampling, keep=True, cancelled=cancelled)

    def _chat(self, messages: Sequence[Message], stream: bool, sampling: dict[str, Any], *,
              keep: bool, cancelled: Cancel | None) -> Answer | Stream:
        start = time.perf_counter()
        ids = prompt_ids(self.loaded, "chat", messages)
        prefix = chat_ids(self.loaded.tokenizer, list(messages[:-1]), generation=False) if len(messages) > 1 else []
        return self._respond(ids, prefix, Sampling.of(sampling), stream, keep=keep, start=start, cancelled=cancelled)

    def complete(self, prompt: str | Sequence[int], *, stream: bool = False, cancelled: Cancel | None = None,
                 **sampling: Any) -> Answer | Stream:
        """The continuation of a plain prompt (no chat template): text, or token ids."""
        start = time.perf_counter()
        ids = prompt_ids(self.loaded, "completion", prompt)
        return self._respond(ids, ids[:-1], Sampling.of(sampling), stream, keep=False, start=start,
                             cancelled=cancelled)

    def fork(self) -> Session:
        """A session over the same model, tiers and document, whose questions and conversations are
        its own from here on."""
        self._check_open()
        twin = Session.__new__(Session)
        twin.__dict__.update(self.__dict__)
        twin._opener, twin.document, twin._states = self._opener or self, None, []   # before anything can fail:
        with self._lock:                                                      # a twin is never an opener
            twin.document = None if self.document is None else self.document.fork()
            twin._messages = list(self._messages)
        return twin

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of every state; the backends close with the session that opened them (not a fork)."""
        with self._lock:             # (a prompt another thread is computing ends first)
            if self.closed:
                return
            self.closed = True
            held = [*self._states, *([self.document] if self.document is not None else [])]
            self._states, self.document = [], None
        if self._opener is not None and self._opener.closed:
            return                       # its tiers closed with the session it was forked from, and all in them
        failed: list[Exception] = []
        for state in held:
            state.release()
        if self._opener is None:
            for backend in self.backends.values():     # every one closed, whichever fails
                try:
                    backend.close()
                except Exception as error:
                    failed.append(error)
        if failed:
            raise failed[0]

    def __del__(self) -> None:
        """A session let go of unclosed (its forks and streams gone too: they hold it) closes its tiers
        without waiting for them: their threads and files go, and what the store holds stays. Nothing
        here waits (a finalizer may run on the tiers' own thread, or as the interpreter exits)."""
        if getattr(self, "closed", True) or getattr(self, "_opener", None) is not None or \
                self.__dict__.get("_made_as") != id(self):       # (a copy of a session shares its tiers)
            return
        self.closed = True
        for backend in self.backends.values():
            backend.manager.close_later()

    def __enter__(self) -> Session:
        self._check_open()
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        """Close; where the block raised, a failure to close (a disk full at the last flush) is logged and
        the block's own error goes on (it replaced it: the user was told of the second failure only)."""
        try:
            self.close()
        except Exception as failed:
            if error is None:
                raise
            log.warning("the session closed after %s, and closing failed too: %s: %s", type(error).__name__,
                        type(failed).__name__, failed)

    def backend(self, mode: str) -> Backend:
        """The engine and tiers of ``mode`` (dense, sparse), made on first use."""
        self._check_open()
        with self._lock:                           # (two threads' first requests open it once)
            if mode not in self.backends:
                self.backends[mode] = open_backend(mode, self.config, self.loaded, record_access=self.record_access)
            return self.backends[mode]

    # -- the request path -----------------------------------------------------------------------------------
    def _respond(self, ids: list[int], prefix: list[int], sampling: Sampling, stream: bool, keep: bool,
                 start: float, cancelled: Cancel | None = None) -> Answer | Stream:
        """``start``: when the request came in (its TTFT counts the prompt's rendering too)."""
        self._check_open()
        if not isinstance(stream, bool):
            raise ConfigError(f"stream={stream!r}: expected True or False")
        if cancelled is not None and not callable(cancelled):
            raise ConfigError(f"cancelled={cancelled!r}: expected a function of no arguments that says whether to "
                              "stop (or None)")
        check_length(ids, self.max_prompt_tokens)
        progress = None if cancelled is None else functools.partial(_stop_if, cancelled)
        prompted = time.perf_counter()
        with self._lock:
            answer, state, logits = self._prompted(ids, prefix, progress, reach=len(ids) + sampling.max_new_tokens)
            self.last_mode = answer.mode = state.mode
            backend = self.backend(state.mode)
            backend.events.record(                       # the prompt's own pass: in the profile's prefill phase
                Event(EventKind.PREFILL, "", "", None, 0, prompted, prompted, time.perf_counter()))
        sampling = self._drafts(sampling, state.mode)
        first = state.computed_from if answer.computed_from is None else min(answer.computed_from, state.computed_from)
        answer.reused_tokens = first          # prompt tokens whose KV this answer did not compute
        answer.ttft_s = time.perf_counter() - start
        pieces = self._finish(state, generate(state, logits, answer, sampling, tokenizer=self.loaded.tokenizer,
                                              eos=backend.eos, events=backend.events,
                                              cancelled=cancelled or (lambda: False)), answer, keep)
        if stream:
            return Stream(pieces, answer, functools.partial(self._settle, state, answer, False),
                          functools.partial(self._unkeep, state))
        for _ in pieces:
            pass
        return answer

    def _prompted(self, ids: list[int], prefix: list[int], progress: Progress | None, *,
                  reach: int) -> tuple[Answer, KVState, Tensor]:
        """The state of the prompt ``ids`` and its last logits, in the mode for ``reach`` positions (the
        prompt's and its answer's at most). Where the tiers have no room for it, the states kept for
        conversations are let go of (not the document's) and it is tried once more: kept states are a
        cache, and one request's must not leave every later one without room."""
        try:
            return self._prompt_once(ids, prefix, progress, reach)
        except BudgetExceeded:
            if not self._states:
                raise
            self._shed()
        return self._prompt_once(ids, prefix, progress, reach)

    def _prompt_once(self, ids: list[int], prefix: list[int], progress: Progress | None,
                     reach: int) -> tuple[Answer, KVState, Tensor]:
        answer, state = Answer(prompt_tokens=len(ids)), None
        try:
            state, covered = self._branch(ids, prefix, answer, progress, reach)
            return answer, state, state.extend(ids[covered:], progress)
        except BaseException:
            if state is not None:
                state.release()
            raise

    def _shed(self) -> None:
        """Let go of every state kept for a conversation's next turn."""
        states, self._states = self._states, []
        for state in states:
            state.release()

    def _drafts(self, sampling: Sampling, mode: str) -> Sampling:
        """Speculative decoding where it gives greedy decoding's tokens: dense mode, temperature 0."""
        k = sampling.draft_tokens or self.config.engine.draft_tokens
        return replace(sampling, draft_tokens=k if mode == "dense" and sampling.temperature == 0 else 0)

    def _finish(self, state: KVState, pieces: Iterator[str], answer: Answer, keep: bool) -> Iterator[str]:
        """``pieces``, then: the state kept for the conversation's next turn, or let go (an answer that
        raised or was not read to its end leaves a state its next turn must not build on)."""
        whole = False
        try:
            while True:
                self._check_open()            # a stream read on after its session closed: its tiers are gone
                piece = next(pieces, None)
                if piece is None:
                    break
                yield piece
            whole = True
        finally:
            pieces.close()
            self._settle(state, answer, keep and whole)

    def _settle(self, state: KVState, answer: Answer, keep: bool) -> None:
        """An answer over: its state kept for the next turn (``keep``), or let go. After the tiers closed
        (with the session, or the one a fork was made from: a stream dropped late) there is nothing to do;
        nor as the interpreter exits (a stream left unfinished and unclosed), when the tiers' thread no
        longer runs. A fork closed meanwhile lets go of the state: its tiers are still open."""
        with self._lock:
            if (self._opener or self).closed or sys.is_finalizing():
                return
            if self.closed:                   # a fork closed meanwhile: its tiers are its opener's, still open
                state.release()
            else:
                answer.report = self.backend(state.mode).report(state)
                if keep:                      # (a stopped answer too: the next turn goes on from its text)
                    self._keep(state)
                else:
                    state.release()
            if not self.keep_events:          # (each answer's stall is its thread's waits, counted apart)
                self.backends[state.mode].events.clear()

    def _branch(self, ids: list[int], prefix: list[int], answer: Answer, progress: Progress | None,
                reach: int) -> tuple[KVState, int]:
        """A fork of the held state that covers most of ``ids`` (the document's prefix state made first
        when it is longer), and how many tokens of ``ids`` it covers; in the mode for ``reach``
        positions (an answer that would decode past the trained window is sparse from its prompt on)."""
        mode = self.config.engine.resolve_mode(reach, self.loaded.spec.max_position)
        best, covered = max(((s, covers(s, ids)) for s in self._held() if s.mode == mode),
                            key=lambda pair: pair[1], default=(None, 0))
        grown = bool(prefix) and ids[:len(prefix)] == prefix and covered < len(prefix)
        if grown:
            best = self._grown(best, covered, prefix, mode, answer, progress)
            covered = len(prefix)
        if best is None or not covered:
            return self.backend(mode).empty(len(ids)), 0
        try:
            fork = fork_at(best, covered)
        except BaseException:
            if grown:
                best.release()
            raise
        if grown:
            self._keep(best)          # (after the fork: with max_states 0 keeping it lets go of it at once)
        return fork, covered

    def _grown(self, best: KVState | None, covered: int, prefix: list[int], mode: str, answer: Answer,
               progress: Progress | None = None) -> KVState:
        """The state of ``prefix``: ``best`` (a held state whose first ``covered`` tokens start it) grown
        to it, or found stored / prefilled."""
        if best is None or not covered:
            state, answer.computed_from = self._prefix_state(prefix, progress, mode)
            return state
        state = fork_at(best, covered)
        try:
            state.absorb(prefix[covered:], progress)
        except BaseException:
            state.release()
            raise
        answer.computed_from = state.computed_from
        return state

    def _prefix_state(self, ids: list[int], progress: Progress | None,
                      mode: str | None = None) -> tuple[KVState, int]:
        mode = mode or self.config.engine.resolve_mode(len(ids) + 1, self.loaded.spec.max_position)
        backend = self.backend(mode)
        # a sparse state starts from the KV a dense one computed of its tokens (an answer to pass the window)
        seeds = (state.seed(ids) for state in self._held() if state.mode == "dense") if mode == "sparse" else ()
        seed = max(filter(None, seeds), key=lambda seed: seed.tokens, default=None)
        backend.events.enabled = self.keep_events    # a 1M-token prefill makes millions of transfer events
        try:
            return backend.state_of(ids, progress, seed=seed)
        finally:
            backend.events.enabled = True

    def _held(self) -> list[KVState]:
        return [*([self.document] if self.document is not None else []), *self._states]

    def _unkeep(self, state: KVState) -> None:
        """Let go of a state kept for the next turn (where it still is)."""
        with self._lock:
            gone = self.closed or (self._opener is not None and self._opener.closed) or sys.is_finalizing()
            if state in self._states and not gone:    # (after the tiers closed, there is nothing to let go of)
                self._states.remove(state)
                state.release()

    def _keep(self, state: KVState) -> None:
        self._states.append(state)
        while len(self._states) > self.max_states:
            self._states.pop(0).release()

    def _check_open(self) -> None:
        if self.closed:
            raise TierKVError("the session is closed")
        if self._opener is not None and self._opener.closed:
            raise TierKVError("the session this one was forked from is closed, and the tiers they shared with it")


def _stop_if(cancelled: Cancel, _tokens: int) -> None:
    """A prompt's progress: `Cancelled` once ``cancelled()`` is true."""
    if cancelled():
        raise Cancelled("the request was cancelled while its prompt was computed")
