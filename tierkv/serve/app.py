"""The HTTP API: OpenAI's chat and text completions over one session, plus health and metrics.

    GET  /v1/models               the one model served
    POST /v1/chat/completions     messages -> reply; stream=true: server-sent events, then [DONE]
    POST /v1/completions          prompt -> continuation (no chat template)
    GET  /health                  {"status": "ok", queue, busy, running, pinned_blocks, held_blocks}; while the
                                  model loads, a 503 {"status": "loading"} (every request: a 503)
    GET  /metrics                 Prometheus text (tierkv.serve.metrics)

Every request runs on the worker's threads (``tierkv.serve.worker``) from the longest stored prefix of its
prompt; ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens that served.
With an API key, /v1/* wants ``Authorization: Bearer KEY`` (401 without). Bodies over the
limit are a 413, malformed ones a 400, both in OpenAI's error format; nothing a client sends
shows it a traceback or stops the server.
"""
from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from tierkv.errors import ConfigError
from tierkv.session import Answer
from tierkv.session.inputs import PromptTooLong, check_length, prompt_ids
from tierkv.session.session import Session
from tierkv.serve.metrics import Metrics
from tierkv.serve.errors import ApiError, as_api_error
from tierkv.serve.guard import Guard
from tierkv.serve.protocol import ChatRequest, CompletionRequest, error_body
from tierkv.serve.worker import Job, QueueFull, Worker


DISCONNECT_POLL_S = 0.25    # how often a whole answer's handler asks whether its client is still there
CLOSING_POLL_S = 0.25       # how often an answer's handler looks whether the server began shutting down


class Closing:
    """The server's shutdown: once it `begin`s, answers in progress and queued may run ``drain_s`` more
    seconds; one still running then ends with a 503 (streamed: an error event), not a silent cut."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s, self.cut_at = drain_s, None

    def begin(self) -> None:
        if self.cut_at is None:
            self.cut_at = time.monotonic() + self.drain_s

    def cut(self) -> ApiError:
        return ApiError(503, f"the server is shutting down: this answer was cut off before it finished "
                             f"(--drain-s {self.drain_s:g}, or a second signal)", kind="server_error",
                        code="server_shutdown")


class Starting:
    """The ASGI app while the model loads: a request gets a 503 that says so (``/health``: status
    "loading"), as load balancers and clients expect, rather than waiting unanswered; once `ready`,
    requests go to the app."""

    def __init__(self, model_name: str) -> None:
        self.model_name, self.app = model_name, None

    def ready(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            body = {"status": "loading", "model": self.model_name} if scope["path"] == "/health" else \
                error_body(f"the model {self.model_name} is loading; try again in a few seconds", kind="server_error",
                           code="model_loading")
            await JSONResponse(body, status_code=503, headers={"Retry-After": "5"})(scope, receive, send)


def create_app(worker: Worker, metrics: Metrics, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = 8 << 20, default_tokens: int = 256, max_new_tokens: int = 4096,
               closing: Closing | None = None) -> FastAPI:
    app = FastAPI(title="tierkv", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    limits = dict(default_tokens=default_tokens, most_tokens=max_new_tokens)
    closing = closing or Closing(0.0)

    app.add_middleware(Guard, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes, routes=app,
                       closing=closing)
    prompts = PromptCheck(worker.session)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if first.get("type") == "json_invalid":
            message, where = f"the body is not valid JSON (at character {where})", None
        elif first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            message = "the request has no body: send a JSON object, with 'Content-Type: application/json'"
        elif first.get("type") == "extra_forbidden":
            message = f"unknown field {where!r}"
        elif kind != "application/json" and not where:
            message = (f"the body must be a JSON object sent with 'Content-Type: application/json' "
                       f"(this one came as {kind or 'no content type'})")
        return JSONResponse(error_body(f"{message}" + (f" ({where})" if where else ""), param=where),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), code=str(error.status_code)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body("internal error; the server's log has the details", kind="server_error"),
                            status_code=500)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tierkv"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        job = _job("chat", body.chat_messages(), body, limits)
        await prompts.check(job, "messages")
        return await _answer(job, body, worker, model_name, request, closing, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        job = _job("completion", body.prompt, body, dict(limits, default_tokens=16))
        await prompts.check(job, "prompt")
        return await _answer(job, body, worker, model_name, request, closing, chat=False)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        pinned, held = await asyncio.to_thread(_pool_figures, worker)
        return {"status": "ok", "model": model_name, "queue": len(worker.jobs), "busy": worker.busy,
                "running": len(worker.running),
                "pinned_blocks": pinned, "held_blocks": held}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        await asyncio.to_thread(metrics.refresh, worker.session)
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    return app


def _pool_figures(worker: Worker) -> tuple[int, int]:
    backends = list(worker.session.backends.values())
    return sum(b.pinned_blocks() for b in backends), sum(b.held_blocks() for b in backends)


class PromptCheck:
    """What refuses a prompt before it runs (its messages, its token ids, its length), checked as the
    request comes in: a refused prompt is a 400 before any stream starts, and an accepted one's stream
    starts at once (a request waiting in the queue gets its headers and pings). On a tokenizer of its own
    in one thread of its own: the worker's is busy, and a fast tokenizer must not be shared between threads."""

    def __init__(self, session: Session) -> None:
        self.loaded, self.most = session.loaded, session.max_prompt_tokens
        self.tokenizer = copy.deepcopy(session.loaded.tokenizer)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-prompt-check")

    async def check(self, job: Job, param: str) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, self._check, job)
        except PromptTooLong as error:
            raise ApiError(400, str(error), param=param, code="context_length_exceeded") from None
        except ConfigError as error:
            raise ApiError(400, str(error), param=param) from None

    def _check(self, job: Job) -> None:
        check_length(prompt_ids(self.loaded, job.kind, job.prompt, self.tokenizer), self.most)


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise ApiError(404, f"model {asked!r} is not served here; this server serves {served!r}",
                       param="model", code="model_not_found")


def _job(kind: str, prompt: Any, body: ChatRequest | CompletionRequest, limits: dict[str, int]) -> Job:
    try:
        sampling = body.sampling(limits["default_tokens"], limits["most_tokens"])
    except (ValueError, ConfigError) as error:
        raise ApiError(400, str(error), param="max_tokens") from None
    return Job(kind, prompt, sampling, asyncio.get_running_loop())


async def _answer(job: Job, body: ChatRequest | CompletionRequest, worker: Worker, model: str, request: Request,
                  closing: Closing, *, chat: bool) -> Any:
    try:
        worker.submit(job)
    except QueueFull as error:
        raise ApiError(503, str(error), kind="server_error", code="server_busy", headers={"Retry-After": "1"}) from None
    reply = _Reply(model, chat)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(_events(job, reply, include_usage, closing), ping=15,   # drained, then cut by
                                   shutdown_grace_period=closing.drain_s + 1)             # _results: not at once
    text = []
    watch = asyncio.create_task(_watch(request, job))
    try:
        async for kind, value in _results(job, closing):
            if kind == "text":
                text.append(value)
            else:
                return reply.whole("".join(text), value)
    finally:
        watch.cancel()
        job.cancel()            # a client that hung up, or an error: stop the work, let go of its state


async def _watch(request: Request, job: Job) -> None:
    """A whole (not streamed) answer's client: once it hangs up, the work stops and the handler ends
    (nothing else tells either: the server only writes when the answer is whole)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()
    job.events.put_nowait(("gone", None))


async def _results(job: Job, closing: Closing) -> AsyncIterator[tuple[str, Any]]:
    while True:
        kind, value = await _next_event(job, closing)
        if kind == "gone":          # its client hung up: nobody reads what would follow
            raise ApiError(499, "the client closed the request", kind="client_closed")
        if kind == "error":
            raise as_api_error(value)
        yield kind, value
        if kind == "done":
            return


async def _next_event(job: Job, closing: Closing) -> tuple[str, Any]:
    """The job's next event; once the server is shutting down, only until its drain is over (an event
    already there is delivered whatever the time: the answer is done, only its client was slow)."""
    if not job.events.empty():
        return job.events.get_nowait()
    get = asyncio.ensure_future(job.events.get())
    try:
        while True:
            left = CLOSING_POLL_S if closing.cut_at is None else closing.cut_at - time.monotonic()
            if left <= 0:
                raise closing.cut()
            done, _ = await asyncio.wait({get}, timeout=min(left, CLOSING_POLL_S))
            if done:
                return get.result()
    finally:
        get.cancel()


async def _events(job: Job, reply: _Reply, include_usage: bool, closing: Closing) -> AsyncIterator[dict[str, str]]:
    """The SSE events of a streamed answer. A client that disconnects cancels this generator, and
    with it the work on the worker."""
    try:
        if reply.chat:
            yield {"data": json.dumps(reply.first())}
        async for kind, value in _results(job, closing):
            if kind == "text":
                yield {"data": json.dumps(reply.piece(value))}
            else:
                yield {"data": json.dumps(reply.last(value))}
                if include_usage:
                    yield {"data": json.dumps(reply.usage_chunk(value))}
        yield {"data": "[DONE]"}
    except ApiError as error:
        yield {"data": json.dumps(error.body)}
    finally:
        job.cancel()


class _Reply:
    """OpenAI's response objects for one answer (whole, or as stream chunks)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str | None, finish: str | None, *, delta: bool, role: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        content = {"role": "assistant"} if role or not delta else {}
        if text is not None:
            content["content"] = text
        return {"index": 0, ("delta" if delta else "message"): content, "finish_reason": finish}

    def whole(self, text: str, answer: Answer) -> dict[str, Any]:
        body = self._envelope(self.object, [self._choice(text, _finish(answer), delta=False)])
        return body | {"usage": usage(answer)}

    def first(self) -> dict[str, Any]:
        chunk = "chat.completion.chunk" if self.chat else self.object
        return self._envelope(chunk, [self._choice("", None, delta=True, role=True)])

    def piece(self, text: str) -> dict[str, Any]:
        chunk = "chat.completion.chunk" if self.chat else self.object
        return self._envelope(chunk, [self._choice(text, None, delta=True)])

    def last(self, answer: Answer) -> dict[str, Any]:
        chunk = "chat.completion.chunk" if self.chat else self.object
        return self._envelope(chunk, [self._choice(None, _finish(answer), delta=True)])

    def usage_chunk(self, answer: Answer) -> dict[str, Any]:
        chunk = "chat.completion.chunk" if self.chat else self.object
        return self._envelope(chunk, []) | {"usage": usage(answer)}


def usage(answer: Answer) -> dict[str, Any]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.generated_tokens,
            "total_tokens": answer.prompt_tokens + answer.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": answer.reused_tokens}}


def _finish(answer: Answer) -> str:
    return "stop" if answer.finish_reason == "stop" else "length"
