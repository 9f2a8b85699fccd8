"""The threads that run requests, in arrival order, on the server's session (``--parallel``, 1 by default).

With one, a request runs alone, and a server without a store must hold a whole prompt's KV in the
tiers (``TiersTooSmall`` where they cannot). With several, answers decode side by side, each on a
fork of the session: more tokens a second in all (1.1-1.3x on two cores, ``bench/threads.py``), and
a short answer is not held up behind a long one; their prompts are still computed one at a time.
They share the tiers' budgets: a request whose KV did not fit beside the others' runs again alone,
before any of its answer went out; one that ran out of room mid-answer ends with a 503. Others
wait in a bounded queue (a full queue is a 503)::

    HTTP handler (event loop)            worker threads
    submit(job) ──queue──▶               session.chat / complete, stream=True
    await job.events  ◀──call_soon_threadsafe──  ("text", piece) ... ("done", answer) | ("error", exc)
    client hung up: job.cancel() ──▶     stops at the prompt's next chunk or the next token; its state
                                         is let go
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tierkv.errors import BudgetExceeded, ConfigError, StoreUnusable, TierKVError
from tierkv.session import Answer, Sampling, Session
from tierkv.session.session import Cancelled
from tierkv.serve.metrics import Metrics

log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.1       # how often a request waiting for its turn looks whether its client left


class TiersTooSmall(BudgetExceeded):
    """A prompt whose KV the tiers of a server without a store cannot hold with no other request running
    beside it: the request is too long for this server, not early."""


class QueueFull(TierKVError):
    """The server has as many requests waiting as it accepts."""


@dataclass(eq=False)
class Job:
    kind: str                              # chat | completion
    prompt: Any                            # messages, or a prompt (text or token ids)
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    sent: bool = False                     # a piece of its answer went to its client
    beside: bool = False                   # another request ran while it did

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value: Any) -> None:
        self.sent = self.sent or kind == "text"
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:      # the server's event loop is closed (shutting down): nobody is listening
            self.cancel()


class Waiting:
    """The requests waiting, in arrival order, at most ``limit`` of them. One whose client has left
    (cancelled) holds no place: it is dropped when a newcomer is counted, so clients that time out
    while they wait never fill the line for the ones that come after."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._jobs: deque[Job | None] = deque()
        self._changed = threading.Condition()

    def put(self, job: Job) -> None:
        with self._changed:
            self._drop_cancelled()
            if len(self._jobs) >= self.limit:
                raise QueueFull(f"{self.limit} requests are waiting already (tierkv serve --max-queue); "
                                "try again later")
            self._jobs.append(job)
            self._changed.notify()

    def end(self) -> None:
        """After the jobs waiting: the worker's threads stop at it."""
        with self._changed:
            self._jobs.append(None)
            self._changed.notify_all()

    def get(self) -> Job | None:
        """The next request; None once ``end`` was reached (it stays there for every thread that asks)."""
        with self._changed:
            self._changed.wait_for(lambda: self._jobs)
            return self._jobs.popleft() if self._jobs[0] is not None else None

    def take_all(self) -> list[Job]:
        with self._changed:
            jobs, self._jobs = [job for job in self._jobs if job is not None], deque()
            return jobs

    def __len__(self) -> int:
        """Requests waiting whose clients still wait."""
        with self._changed:
            self._drop_cancelled()
            return sum(job is not None for job in self._jobs)

    def _drop_cancelled(self) -> None:
        if any(job is not None and job.cancelled.is_set() for job in self._jobs):
            self._jobs = deque(job for job in self._jobs if job is None or not job.cancelled.is_set())


class Worker:
    """``parallel`` threads answering the requests waiting, each request on a fork of the session.

    A request whose KV did not fit the tiers beside the others' (``BudgetExceeded`` before its first
    token) runs again once nothing else runs, and nothing starts beside it meanwhile.
    """

    def __init__(self, session: Session, metrics: Metrics, *, max_queue: int = 16, parallel: int = 1) -> None:
        self.session, self.metrics = session, metrics
        self.jobs = Waiting(max_queue)
        self.running: set[Job] = set()        # the requests running
        self._taken: set[Job] = set()         # those and the ones a thread took that wait for their turn
        self._alone: Job | None = None        # the one running with nothing beside it
        self._wanting_alone: deque[Job] = deque()   # waiting to run alone, in turn: none starts beside them
        self._turns = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name=f"tierkv-serve-{i}", daemon=True)
                         for i in range(parallel)]
        self._cancelling = False              # stop(cancel=True) was called: every request taken stops
        metrics.running.set_function(lambda: len(self.running))
        metrics.queued.set_function(lambda: len(self.jobs))

    @property
    def busy(self) -> bool:
        """A thread holds a request: running, or waiting for its turn."""
        return bool(self._taken)

    def start(self) -> Worker:
        for thread in self._threads:
            thread.start()
        return self

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self, *, cancel: bool = False) -> None:
        """Drop the waiting requests (their clients get an error, where they still listen), then stop once
        the requests running are over; ``cancel``: stop those too, at their next token (the server has
        stopped listening: nobody would read the rest)."""
        for job in self.jobs.take_all():
            job.emit("error", TierKVError("the server is shutting down"))
        with self._turns:
            self._cancelling = cancel
            taken = list(self._taken) if cancel else []
        for job in taken:
            job.cancel()
        self.jobs.end()
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            with self._turns:
                self._taken.add(job)
                if self._cancelling:
                    job.cancel()
            try:
                if not job.cancelled.is_set():          # (its client left while it waited: nothing to do)
                    self._answer(job)
            finally:
                self._done(job)

    def _answer(self, job: Job) -> None:
        try:
            try:
                self._turn(job)
                self._serve(job)
            except BudgetExceeded:
                if not job.beside or job.sent:      # the tiers are too small for it, or its client has a part
                    raise
                self._turn(job, alone=True)
                self._serve(job)
        except Cancelled:                    # its client left while it waited for its turn or its prompt ran
            self.metrics.cancelled.inc()
        except Exception as error:           # the job's error goes to its client; the server goes on
            if not isinstance(error, TierKVError):
                log.exception("request failed")
            elif not isinstance(error, ConfigError) or isinstance(error, StoreUnusable):   # the server's
                log.warning("request failed: %s", error)            # trouble, not the request's: said here
            if isinstance(error, BudgetExceeded) and self.session.config.tiers.nvme_dir is None and (
                    not job.beside or job is self._alone):
                error = TiersTooSmall(str(error))    # (beside others: the server's load, a 503)
            job.emit("error", error)

    def _turn(self, job: Job, *, alone: bool = False) -> None:
        """Count ``job`` in as running once no request runs alone or waits to (``alone``: once none runs
        at all, before any request taken after it, and after those waiting to run alone before it).
        Raises Cancelled if its client leaves meanwhile."""
        with self._turns:
            if alone:
                self.running.discard(job)
                self._wanting_alone.append(job)
                self._turns.notify_all()
                log.info("a request's KV did not fit the tiers beside the others': it runs again alone")
            try:
                free = (lambda: self._alone is None and not self.running and self._wanting_alone[0] is job) \
                    if alone else (lambda: self._alone is None and not self._wanting_alone)
                while not self._turns.wait_for(lambda: free() or job.cancelled.is_set(), timeout=CANCEL_POLL_S):
                    pass
            finally:
                if alone:
                    self._wanting_alone.remove(job)
            if job.cancelled.is_set():
                self._turns.notify_all()
                raise Cancelled("its client left while it waited for its turn")
            self.running.add(job)
            if alone:
                self._alone = job
            elif len(self.running) > 1:
                for running in self.running:
                    running.beside = True

    def _done(self, job: Job) -> None:
        with self._turns:
            self.running.discard(job)
            self._taken.discard(job)
            if self._alone is job:
                self._alone = None
            self._turns.notify_all()

    def _serve(self, job: Job) -> None:
        started = time.perf_counter()
        stream = self._start(job)
        answer: Answer = stream.answer
        try:
            for piece in stream:
                if job.cancelled.is_set():
                    break
                job.emit("text", piece)
        finally:
            stream.close()                   # a cancelled answer lets go of its state here
        log.info("%s, %s mode: %d prompt tokens (%d stored), first token after %.3f s (%.3f s queued), %d tokens "
                 "at %.2f tok/s, %s", job.kind, answer.mode, answer.prompt_tokens, answer.reused_tokens,
                 answer.ttft_s, started - job.submitted, answer.generated_tokens, answer.decode_tokens_per_s,
                 answer.finish_reason)
        try:
            self.metrics.answered(answer, time.perf_counter() - job.submitted, self.session)
        except Exception:                    # figures are not worth an answer
            log.exception("metrics not updated")
        if job.cancelled.is_set():
            self.metrics.cancelled.inc()
        else:
            job.emit("done", answer)

    def _start(self, job: Job):
        args = dict(stream=True, cancelled=job.cancelled.is_set, **_sampling_args(job.sampling))
        if job.kind == "chat":
            return self.session.chat(job.prompt, **args)
        return self.session.complete(job.prompt, **args)


def _sampling_args(sampling: Sampling) -> dict[str, Any]:
    return {name: getattr(sampling, name) for name in Sampling.__dataclass_fields__}
