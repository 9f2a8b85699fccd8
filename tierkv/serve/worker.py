"""The one thread that runs requests, in arrival order, on the server's session.

One request runs at a time: the tiers' budgets are the server's as a whole, and a server without
a store must hold a whole prompt's KV in them (``TiersTooSmall``). Answers decoded side by side
on the session's forks would give more tokens a second in all (1.1-1.3x on two cores,
``bench/threads.py``), each one later, but they would share those budgets; the server does not
take that yet. Others wait in a bounded queue (a full queue is a 503)::

    HTTP handler (event loop)            worker thread
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


class TiersTooSmall(BudgetExceeded):
    """A prompt whose KV the tiers of a server without a store cannot hold: nothing else holds them (one
    request runs at a time), so the request is too long for this server, not early."""


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

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value: Any) -> None:
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
        """After the jobs waiting: the worker stops at it."""
        with self._changed:
            self._jobs.append(None)
            self._changed.notify()

    def get(self) -> Job | None:
        with self._changed:
            self._changed.wait_for(lambda: self._jobs)
            return self._jobs.popleft()

    def take_all(self) -> list[Job]:
        with self._changed:
            jobs, self._jobs = [job for job in self._jobs if job is not None], deque()
            return jobs

    def __len__(self) -> int:
        """Requests waiting whose clients still wait."""
        with self._changed:
            self._drop_cancelled()
            return len(self._jobs)

    def _drop_cancelled(self) -> None:
        if any(job is not None and job.cancelled.is_set() for job in self._jobs):
            self._jobs = deque(job for job in self._jobs if job is None or not job.cancelled.is_set())


class Worker:
    def __init__(self, session: Session, metrics: Metrics, *, max_queue: int = 16) -> None:
        self.session, self.metrics = session, metrics
        self.jobs = Waiting(max_queue)
        self.busy = False
        self.current: Job | None = None       # the request running
        self._thread = threading.Thread(target=self._run, name="tierkv-serve", daemon=True)

    def start(self) -> Worker:
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        self.jobs.put(job)
        self.metrics.queued.set(len(self.jobs))

    def stop(self, *, cancel: bool = False) -> None:
        """Drop the waiting requests (their clients get an error, where they still listen), then stop once
        the request running is over; ``cancel``: stop that one too, at its next token (the server has
        stopped listening: nobody would read the rest)."""
        for job in self.jobs.take_all():
            job.emit("error", TierKVError("the server is shutting down"))
        if cancel and (running := self.current) is not None:
            running.cancel()
        self.jobs.end()
        self._thread.join()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.metrics.queued.set(len(self.jobs))
            if job.cancelled.is_set():
                continue                     # its client left while it waited
            self.busy, self.current = True, job
            try:
                self._serve(job)
            except Cancelled:                # its client left while its prompt was computed
                self.metrics.cancelled.inc()
            except Exception as error:       # the job's error goes to its client; the server goes on
                if not isinstance(error, TierKVError):
                    log.exception("request failed")
                elif not isinstance(error, ConfigError) or isinstance(error, StoreUnusable):   # the server's
                    log.warning("request failed: %s", error)            # trouble, not the request's: said here
                if isinstance(error, BudgetExceeded) and self.session.config.tiers.nvme_dir is None:
                    error = TiersTooSmall(str(error))
                job.emit("error", error)
            finally:
                self.busy, self.current = False, None

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
                 "at %.2f tok/s, %s", job.kind, self.session.last_mode, answer.prompt_tokens, answer.reused_tokens,
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
