"""``tierkv batch --ray``: the same job as a Ray Data pipeline over a pool of tierkv actors.

    read inputs, skip ids already in --out      (driver, as the single-process job)
    Dataset of the documents left               ray.data.from_items, batches of --ray-batch documents
      -> map_batches(Summarizer)                one actor per worker: its own model copy, tiers, budgets
                                                and scratch store; it calibrates this machine and
                                                searches its own FlexGen policy (tierkv.schedule.job.summarize)
      -> records                                one JSON line per document, errors included
    driver appends each record to --out as it streams back (flushed: a rerun skips it)

A document that fails is one error line, not a failed job: a batch that raises is run again one
document at a time, and the document that still raises gets its error. A worker that is killed is
restarted by Ray and its batch retried, up to ``retries`` times; a batch that kills its worker every
time (a document that runs it out of memory, say) is skipped, its documents are run again one at a
time, and the one that still kills its worker gets an error line. Where no document got through at
all (the output holds none), nothing is written and the job fails (the cause is likelier the setup
than the documents): a rerun retries them. Each document is written once.

``address`` is ``local`` (start a Ray instance in this process, on this machine's cores) or what
``ray start --head`` printed (``ray://host:10001`` or ``host:6379``), or ``auto``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import ConfigError, TierKVError
from tierkv.failpoints import failpoint
from tierkv.schedule.documents import FAILED, Document, OutputLog, finished, read_inputs
from tierkv.schedule.job import JobConfig, JobResult, Progress, check_here, compute_dtype
from tierkv.schedule.policy import Policy, read_policy

log = logging.getLogger(__name__)
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}    # as the CLI: spinning OpenMP threads starve tierkv's I/O threads
MAX_BATCH = 64      # documents per worker call at most by default: a killed worker redoes at most these
RETRIES = 3         # a batch whose worker died is run again at most this many times
JOB_CONTEXT = {"enable_progress_bars": False,          # Ray Data's settings for the job (tierkv draws the progress)
               "print_on_execution_start": False,
               "max_errored_blocks": -1}               # a batch that killed its workers is skipped, then run alone


@dataclass(frozen=True, slots=True)
class RayOptions:
    address: str = "local"
    workers: int = 1
    cpus_per_worker: float | None = None     # None: the cores of a local instance shared out, else 1
    gpus_per_worker: float = 0.0
    batch_documents: int | None = None       # documents per actor call (a retry redoes at most these); None:
                                             # the documents shared out among the workers, at most MAX_BATCH
    retries: int = RETRIES                   # runs of a batch again after its worker died

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers={self.workers}: must be >= 1")
        if self.retries < 0:
            raise ConfigError(f"--ray-retries={self.retries}: must be >= 0")
        if self.batch_documents is not None and self.batch_documents < 1:
            raise ConfigError(f"--ray-batch={self.batch_documents}: must be >= 1")
        if self.cpus_per_worker is not None and self.cpus_per_worker <= 0:
            raise ConfigError(f"--cpus-per-worker={self.cpus_per_worker}: must be > 0")
        if self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker={self.gpus_per_worker}: must be >= 0")


JOB_ERROR = "job_error"      # a worker's record of an error in the job's settings (no document's line)


class Summarizer:
    """A Ray actor: loads the model once, then summarizes batches of documents into JSON records."""

    def __init__(self, config: JobConfig, threads: int, fixed: Policy | None = None) -> None:
        """``fixed``: the ``--policy`` the driver read (None: each batch searches its own)."""
        import torch

        from tierkv.model.loading import load_model
        torch.set_num_threads(max(1, threads))
        with contextlib.suppress(OSError):          # a cluster that nices its workers: undo it where allowed
            if os.getpriority(os.PRIO_PROCESS, 0) > 0:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        self.config, self.fixed = config, fixed
        self.loaded = load_model(config.model, dtype=compute_dtype(config.dtype))

    def __call__(self, batch: dict) -> dict:
        failpoint("batch.worker-call")
        docs = [Document(str(i), t, e) for i, t, e in zip(batch["id"], batch["text"], batch["error"])]
        docs = [Document(d.id, d.text if isinstance(d.text, str) else None,
                         d.error if isinstance(d.error, str) else None) for d in docs]
        for doc in docs:
            failpoint("batch.worker-document", doc.id)
        records: list[dict] = []
        try:
            self._summarize(docs, records.append)
        except ConfigError as error:            # the job's settings, not a document's: the job stops, as it
            return {"record": [json.dumps({"id": docs[0].id, JOB_ERROR: str(error)})]}   # does in one process
        except Exception:                       # one bad document must not fail the others: one at a time
            records = []
            for doc in docs:
                try:
                    self._summarize([doc], records.append)
                except Exception as error:      # the document's own error line
                    records.append({"id": doc.id, "error": f"{FAILED}{type(error).__name__}: {error}"})
        return {"record": [json.dumps(r, ensure_ascii=False) for r in records]}

    def _summarize(self, docs: list[Document], write: Callable[[dict], None]) -> None:
        from tierkv.schedule.job import summarize
        summarize(self.config, self.loaded, docs, write, fixed=self.fixed)


def run_ray_job(config: JobConfig, options: RayOptions, *, progress: Progress | None = None) -> JobResult:
    """Summarize ``config.inputs`` into ``config.out`` through Ray; resumes like ``run_job``."""
    fixed = None if config.policy == "auto" else read_policy(Path(config.policy))   # fail before Ray starts
    if options.address == "local":            # (a cluster's workers may hold a model the driver does not)
        check_here(config)
    docs = read_inputs(config.inputs, out=config.out)
    if options.address != "local":           # tried before --out is made or changed: a refused address leaves
        address = _address(options.address)  # nothing behind; not where a resume has nothing left to do
        if {d.id for d in docs} - finished(config.out, retry_failed=config.retry_failed):
            _check_reachable(*address)
    result, made = JobResult(), not config.out.exists()
    try:
        with OutputLog(config.out, config.output_settings(fixed), retry_failed=config.retry_failed) as out:
            todo = [d for d in docs if d.id not in out.done]
            result.skipped = len(docs) - len(todo)
            if not todo:
                return result
            with contextlib.redirect_stdout(sys.stderr):     # Ray reports dead workers on stdout: --json owns it
                _run(config, options, todo, out, result, progress, fixed)
    except ConfigError:                      # the job's settings: an --out it made holds nothing
        if made and config.out.is_file() and config.out.stat().st_size == 0:
            config.out.unlink()
        raise
    return result


def _run(config: JobConfig, options: RayOptions, todo: list[Document], out: OutputLog, result: JobResult,
         progress: Progress | None, fixed: Policy | None) -> None:
    ray, saved = _start(options)
    try:
        threads = _threads(ray, options)
        cpus = options.cpus_per_worker or threads
        _check_fits(ray, options, cpus)
        batch = options.batch_documents or min(MAX_BATCH, -(-len(todo) // options.workers))
        if progress:
            progress(0, 0, 0.0, len(todo))
        began = time.perf_counter()

        def records(docs: list[Document], size: int):
            """The records of ``docs`` in batches of ``size``; a batch that killed its worker every time
            is left out (its documents get none)."""
            dataset = ray.data.from_items([{"id": d.id, "text": d.text, "error": d.error} for d in docs])
            # one batch a worker at a time: a worker that dies takes its own batch with it, not batches queued
            # behind it (their retries would run out on a poison document's account)
            pool = ray.data.ActorPoolStrategy(size=options.workers, max_tasks_in_flight_per_actor=1)
            with warnings.catch_warnings():       # restarts and retries have no named parameter yet (Ray < 2.64,
                warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")   # as pinned)
                rows = dataset.map_batches(
                    Summarizer, fn_constructor_kwargs={"config": config, "threads": threads, "fixed": fixed},
                    batch_size=size, compute=pool, num_cpus=cpus, num_gpus=options.gpus_per_worker or None,
                    batch_format="numpy", max_restarts=-1, max_task_retries=options.retries,
                    runtime_env={"env_vars": WORKER_ENV}).iter_rows()
            return (json.loads(row["record"]) for row in rows)

        _write(records(todo, batch), out, result, progress, len(todo))
        left = [d for d in todo if d.id not in out.done]
        if left and batch > 1:               # the batches that killed their workers, one document at a time
            _write(records(left, 1), out, result, progress, len(todo))
            left = [d for d in todo if d.id not in out.done]
        if left and not out.done:
            raise TierKVError(f"--ray: every task failed ({len(left)} document(s), each tried {options.retries + 1} "
                              "time(s)): the workers died before finishing any (out of memory, or killed), or "
                              "could not start; nothing was written, so a rerun retries them")
        died = f"{FAILED}the worker running it died at every try (killed, out of memory or crashed; --ray-retries " \
               f"{options.retries})"
        _write(({"id": doc.id, "error": died} for doc in left), out, result, progress, len(todo))
        result.seconds = time.perf_counter() - began
    finally:
        if options.address == "local":
            ray.shutdown()
        _restore(ray, saved)


def _write(records: Iterable[dict], out: OutputLog, result: JobResult, progress: Progress | None,
           total: int) -> None:
    last = time.perf_counter()
    for record in records:
        if JOB_ERROR in record:
            raise ConfigError(record[JOB_ERROR])
        if record["id"] in out.done:         # a retried batch's second answer
            continue
        out.write(record)
        result.documents += 1
        result.failed += "error" in record
        result.generated_tokens += record.get("tokens", 0)
        now = time.perf_counter()
        if progress:
            progress(1, record.get("tokens", 0), now - last, total)
        last = now


def _start(options: RayOptions):
    if options.address != "local":
        if "RAY_AUTH_MODE" not in os.environ and Path("~/.ray/auth_token").expanduser().is_file():
            os.environ["RAY_AUTH_MODE"] = "token"   # what `ray start --head` turns on, with this token (read at import)
    # Ray starts workers at niceness 15, for work that should yield to the rest of the machine; here the
    # workers are the job, and on a small host everything else (Ray's own actors, the driver) preempts them
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'tierkv-runtime[ray]'") from None
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    context, logger = ray.data.DataContext.get_current(), logging.getLogger("ray.data")
    saved = {name: getattr(context, name) for name in JOB_CONTEXT} | {"level": logger.level}
    for name, value in JOB_CONTEXT.items():
        setattr(context, name, value)
    logger.setLevel(logging.CRITICAL)            # tierkv draws the progress and says what failed
    terminate = signal.getsignal(signal.SIGTERM)
    try:
        _init(ray, options)
    except BaseException:
        _restore(ray, saved)
        raise
    finally:                                     # ray.init puts in its own: SIGTERM would abort, not close what is open
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, terminate)
    return ray, saved


def _restore(ray, saved: dict) -> None:
    """Ray Data's settings and logger as the calling process had them (a later job of its own must not
    skip failed blocks silently)."""
    context = ray.data.DataContext.get_current()
    for name in JOB_CONTEXT:
        setattr(context, name, saved[name])
    logging.getLogger("ray.data").setLevel(saved["level"])


def _init(ray, options: RayOptions) -> None:
    if options.address == "local":
        for attempt in (1, 2):       # on a loaded machine Ray's own start can miss its connect timeout
            try:
                ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                         ignore_reinit_error=True)
                break
            except (ConnectionError, RuntimeError, TimeoutError) as error:
                ray.shutdown()
                if attempt == 2:
                    raise ConfigError(f"--ray local: Ray did not start ({error})") from None
                log.warning("--ray local: Ray did not start (%s); trying once more", error)
    else:
        try:
            ray.init(address=options.address, log_to_driver=False, configure_logging=False,
                     ignore_reinit_error=True)
        except ConnectionError as error:
            raise ConfigError(f"--ray {options.address}: no Ray cluster there, or it refused this process's "
                              f"token ({error}); start one with `ray start --head`, set RAY_AUTH_MODE and "
                              f"RAY_AUTH_TOKEN as the cluster has them, or give --ray local") from None


def _address(address: str) -> tuple[str, str | None, int | None]:
    """``--ray ADDRESS`` checked for its form: (the address, its host, its port); auto has neither."""
    if address == "auto":
        return address, None, None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray {address!r}: expected local, auto, host:port or ray://host:port "
                          f"(what `ray start --head` prints)")
    return address, host, int(port)


def _check_reachable(address: str, host: str | None, port: int | None, timeout_s: float = 5.0) -> None:
    """Fail fast on a host:port nobody listens on (Ray itself retries a missing cluster for minutes)."""
    if host is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigError(f"--ray {address}: no Ray cluster there ({error.strerror or error}); start one with "
                          f"`ray start --head`, or give --ray local") from None


def _check_fits(ray, options: RayOptions, cpus: float) -> None:
    """Refuse workers the cluster cannot start all of (Ray would wait for them, saying nothing)."""
    have = ray.cluster_resources()
    for name, each, flag in (("CPU", cpus, "--cpus-per-worker"), ("GPU", options.gpus_per_worker, "--gpus-per-worker")):
        if options.workers * each > have.get(name, 0):
            raise ConfigError(f"--workers {options.workers} x {flag} {each:g}: the Ray cluster has "
                              f"{have.get(name, 0):g} {name}(s) in all, so not every worker could start; "
                              "ask for fewer")


def _threads(ray, options: RayOptions) -> int:
    """Cores per worker: given, or the cluster's shared out among the workers."""
    if options.cpus_per_worker is not None:
        return max(1, int(options.cpus_per_worker))
    cores = int(ray.cluster_resources().get("CPU", 1))
    return max(1, cores // options.workers)
