"""``tierkv serve``: an OpenAI-compatible HTTP server over one model and its tiered KV.

    tierkv serve --nvme-dir /mnt/nvme/kv --gpu-budget 2GiB --port 8000 [--api-key KEY]

It binds 127.0.0.1 unless told otherwise (``--host 0.0.0.0`` exposes it: give it an
``--api-key`` then). Prompts whose start is stored (a document asked about before, by this
server or any earlier run on the same store) are not computed again.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tierkv.errors import ConfigError
from tierkv.flags import add_flags, build, given, setting
from tierkv.model.settings import SessionConfig, mode_flags
from tierkv.serve.listen import DEFAULT_HOST, DEFAULT_PORT, take, url_host
from tierkv.sizes import parse_size

MOST_PARALLEL = 64


@dataclass(frozen=True, slots=True)
class ServeSettings:
    host: str = setting(DEFAULT_HOST, "address to listen on (0.0.0.0: every interface; give --api-key then)")
    port: int = setting(DEFAULT_PORT, "TCP port")
    api_key: str | None = setting(None, "clients must send 'Authorization: Bearer KEY' (default: no key)",
                                  metavar="KEY")
    served_name: str | None = setting(None, "the model's name in the API (default: --model's)", metavar="NAME")
    parallel: int = setting(1, "requests answered side by side, each on a thread of its own (their prompts are "
                               "computed one at a time; they share the tiers' budgets)", metavar="N")
    max_queue: int = setting(16, "requests that may wait for those running; more get a 503", metavar="N")
    max_prompt_tokens: int = setting(1 << 20, "longest prompt taken, in tokens (longer: a 400)", metavar="N")
    max_new_tokens: int = setting(4096, "most tokens one answer may ask for (max_tokens)", metavar="N")
    max_body_bytes: str | int = setting("16MiB", "largest request body taken (larger: a 413)", metavar="SIZE")
    drain_s: float = setting(30.0, "on SIGTERM or Ctrl-C, seconds the answers in progress or queued may take to "
                                   "finish; one still running then ends with a 503 (streamed: an error event), "
                                   "as all do at a second signal; a third exits at once", metavar="SECONDS")

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port={self.port}: must be 1..65535")
        for name in ("parallel", "max_queue", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.parallel > MOST_PARALLEL:
            raise ConfigError(f"parallel={self.parallel}: at most {MOST_PARALLEL} (each runs a thread and a fork of "
                              "the session; past the cores, more only share them)")
        if not self.drain_s >= 0:
            raise ConfigError(f"drain_s={self.drain_s}: must be >= 0")
        if self.api_key is not None and (not self.api_key.strip() or self.api_key != self.api_key.strip()):
            raise ConfigError("--api-key: empty, or with spaces at its ends (a client's 'Bearer KEY' could not "
                              "carry it); give the key itself, or leave the flag out for no key")
        if self.served_name is not None and not self.served_name.strip():
            raise ConfigError("--served-name: empty; give the name clients ask for, or leave it out (--model's)")
        object.__setattr__(self, "max_body_bytes", parse_size(self.max_body_bytes, "max_body_bytes"))


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics "
                                   "for one model. A prompt's stored prefix (a document asked about before) is "
                                   "reused, across requests and restarts.")
    add_flags(p, ServeSettings)
    add_flags(p, SessionConfig)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tierkv.serve.app import Closing, Starting
    from tierkv.serve.guard import HeadersInTime
    settings, config = build(ServeSettings, given(args, ServeSettings)), build(SessionConfig, given(args, SessionConfig))
    config.engine.check_flags(*mode_flags(args))
    listener = take(settings.host, settings.port)     # (taken already by `tierkv`) before the model loads
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        print(f"tierkv serve: warning: listening on {settings.host} without --api-key: anyone who can reach it "
              "can use it", file=sys.stderr)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("tierkv.serve").setLevel(logging.INFO)       # one line per answer
    name = settings.served_name or config.engine.model
    starting, closing = Starting(name), Closing(settings.drain_s)
    server = uvicorn.Server(uvicorn.Config(starting, log_level="warning", lifespan="off", http=HeadersInTime,
                                           timeout_graceful_shutdown=settings.drain_s + 2))
    server.handle_exit = functools.partial(_stop, server, server.handle_exit, closing, starting)   # (its signals')
    url = f"http://{url_host(settings.host)}:{settings.port}/v1"
    print(f"tierkv serve: loading {config.engine.model} (requests get a 503 until it is ready) ...", file=sys.stderr,
          flush=True)
    load = _Load(settings, config, name, url, starting, closing, server)
    try:
        load.thread.start()
        server.run(sockets=[listener])
    except KeyboardInterrupt:       # the signal it stopped for, raised again once it stopped: a clean stop
        if not server.should_exit:
            raise
    finally:
        try:
            load.close()            # the server no longer listens: the answer running stops too
        finally:
            listener.close()
            print("tierkv serve: stopped", file=sys.stderr, flush=True)
    if load.failed is not None:
        raise load.failed
    return 0


@dataclass
class _Load:
    """The model, session and worker, made on a thread while the server answers 503s (`Starting`);
    a failure stops the server and is raised by ``cmd_serve`` once it has."""
    settings: ServeSettings
    config: SessionConfig
    name: str
    url: str
    starting: Any                  # tierkv.serve.app.Starting
    closing: Any                   # tierkv.serve.app.Closing
    server: Any                    # uvicorn.Server
    session: Any = None
    worker: Any = None
    failed: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="tierkv-serve-load", daemon=True)
        self.lock = threading.Lock()         # the load's end against a stop: one of them closes what it made

    def _run(self) -> None:
        from tierkv.serve.app import create_app
        from tierkv.serve.metrics import Metrics
        from tierkv.serve.worker import Worker
        from tierkv.session import Session
        try:
            self.session = Session(self.config, max_prompt_tokens=self.settings.max_prompt_tokens)
            mode = self.config.engine.mode
            for used in ("dense", "sparse") if mode == "auto" else (mode,):
                self.session.backend(used)   # a store that cannot be used stops the start, not every request
            metrics = Metrics()
            self.worker = Worker(self.session, metrics, max_queue=self.settings.max_queue,
                                 parallel=self.settings.parallel).start()
            app = create_app(self.worker, metrics, model_name=self.name, api_key=self.settings.api_key,
                             closing=self.closing, max_body_bytes=self.settings.max_body_bytes,
                             max_new_tokens=self.settings.max_new_tokens)
        except BaseException as error:       # (a missing model, a store that cannot be made, ...)
            self.failed = error
            self._close_made()               # (a session made before a store failed to open), then the stop
            self.server.should_exit = True
            return
        with self.lock:
            if not self.server.should_exit:
                self.starting.ready(app)
                print(f"tierkv serve: {self.name} on {self.url}", file=sys.stderr, flush=True)
                return
        self._close_made()                   # stopped while it loaded: nobody else will

    def close(self) -> None:
        """Stops the worker and closes the session (what the tiers hold is written back whatever
        happened). A load still running is not waited for: it closes what it makes, or dies with the
        process, having served nothing."""
        with self.lock:
            if self.thread.is_alive() and self.starting.app is None:
                return
        self.thread.join()
        self._close_made()

    def _close_made(self) -> None:
        with self.lock:
            worker, session, self.worker, self.session = self.worker, self.session, None, None
        try:
            if worker is not None:
                worker.stop(cancel=True)
        finally:
            if session is not None:
                session.close()


def _stop(server, handle_exit, closing, starting, sig: int, frame: object) -> None:
    """SIGTERM or Ctrl-C: the first stops uvicorn listening and starts the answers' drain (`Closing`;
    uvicorn waits for the requests open); the second ends every answer at once, each with its error;
    a third exits without waiting for them. While the model loads, the first stops at once."""
    if not server.should_exit and starting.app is None:
        print("tierkv serve: stopping (the model had not finished loading)", file=sys.stderr, flush=True)
        closing.begin()
        handle_exit(sig, frame)
    elif not server.should_exit:
        print(f"tierkv serve: stopping: answers in progress may take {closing.drain_s:g} s more (--drain-s); "
              "a second signal ends them now", file=sys.stderr, flush=True)
        closing.begin()
        handle_exit(sig, frame)
    elif closing.cut_at is not None and closing.cut_at > time.monotonic():
        print("tierkv serve: stopping now: the answers in progress end with an error (a third signal exits "
              "without them)", file=sys.stderr, flush=True)
        closing.cut_at = time.monotonic()
    else:
        server.force_exit = True
