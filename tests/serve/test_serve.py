"""``tierkv serve`` through real clients: the openai package and raw HTTP, a real server process."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from servers import API_KEY, free_port

pytestmark = pytest.mark.model
DOC = ("Alice met Bob in Paris in 1999. They founded a bakery called Blue Oven on Rue Cler. "
       "The bakery became famous for its rye bread. In 2010 they opened a second shop in Lyon.\n") * 12
SMALL = ["--gpu-budget", "8MiB", "--cpu-budget", "16MiB"]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def ask(c: openai.OpenAI, question: str, *, model: str = "smollm2", doc: str = DOC, **kw):
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": doc},
                                                            {"role": "user", "content": question}],
                                     max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw)


def test_chat_stream_completion_and_reuse_across_requests_and_restarts(launch, tmp_path):
    store = str(tmp_path / "store")
    server = launch("--nvme-dir", store, *SMALL)
    health, completion = server.loading       # while the model loaded: a 503 that says so, not a wait
    assert health.status_code == 503 and health.json() == {"status": "loading", "model": "smollm2"}
    assert completion.status_code == 503 and completion.json()["error"]["code"] == "model_loading"
    assert completion.headers["retry-after"] == "5"
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["smollm2"]
    first = ask(c, "Who founded the bakery?")
    second = ask(c, "Where was the second shop?")
    assert first.choices[0].message.content and first.usage.completion_tokens == 8
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and second.usage.prompt_tokens - cached < 300          # only the question computed
    pieces = [chunk for chunk in ask(c, "What bread is it famous for?", stream=True,
                                     stream_options={"include_usage": True})]
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert text and pieces[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert pieces[-2].choices[0].finish_reason in ("stop", "length")
    done = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 4
    assert server.stop() == 0
    again = launch("--nvme-dir", store, *SMALL)                              # a restart finds the document
    after = ask(client(again), "Where was the second shop?")
    assert after.usage.prompt_tokens_details.cached_tokens >= cached - cached % 256   # its whole blocks were stored
    assert after.choices[0].message.content == second.choices[0].message.content


def test_a_sparse_document_past_the_trained_window_is_prefilled_once(launch, tmp_path, tiny_model_dir):
    """The tiny model's window is 512 tokens: this 1.5K-token document runs sparse (mode auto)."""
    server = launch("--model", str(tiny_model_dir), "--served-name", "tiny", "--nvme-dir", str(tmp_path / "s"),
                    "--chunk-tokens", "256", "--sparse-budget", "128", *SMALL)
    c = client(server)
    doc = DOC * 2
    first = ask(c, "Who founded the bakery?", model="tiny", doc=doc)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert first.usage.prompt_tokens > 512
    second = ask(c, "Where was the second shop?", model="tiny", doc=doc)
    assert second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens < 40
    assert server.stop() == 0
    again = launch("--model", str(tiny_model_dir), "--served-name", "tiny", "--nvme-dir", str(tmp_path / "s"),
                   "--chunk-tokens", "256", "--sparse-budget", "128", *SMALL)
    third = ask(client(again), "Where was the second shop?", model="tiny", doc=doc)
    assert third.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens
    assert third.choices[0].message.content == second.choices[0].message.content
    assert "tierkv_prefix_cache_hit_tokens_total" in metrics


def test_a_client_that_hangs_up_mid_stream_leaves_nothing_pinned(launch, tmp_path):
    server = launch("--nvme-dir", str(tmp_path / "store"), *SMALL)
    ask(client(server), "Who founded the bakery?")                   # the document's state is held from here
    held = server.idle()["held_blocks"]
    body = {"model": "smollm2", "stream": True, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": DOC}, {"role": "user", "content": "Tell me everything."}]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data:") for line in got)
    state = server.settled()
    assert state["held_blocks"] == held
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "tierkv_cancelled_total 1.0" in metrics and "tierkv_pinned_blocks 0.0" in metrics


def test_bad_requests_get_openai_errors_and_the_server_lives_on(launch, tmp_path):
    server = launch("--nvme-dir", str(tmp_path / "store"), "--max-body-bytes", "64KiB", "--max-prompt-tokens", "600",
                    *SMALL)
    url, key = f"{server.url}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        (httpx.post(url, json={"model": "smollm2", "messages": []}), 401, "API key"),
        (httpx.post(url, content=b"{not json", headers=key | {"content-type": "application/json"}), 400,
         "not valid JSON (at character 1)"),
        (httpx.post(url, headers=key), 400, "the request has no body: send a JSON object"),
        (httpx.post(url, data={"model": "smollm2"}, headers=key), 400,                     # a form, as curl -d sends
         "sent with 'Content-Type: application/json' (this one came as application/x-www-form-urlencoded)"),
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "wat": 1},
                    headers={"authorization": f"bearer {API_KEY}"}), 400, "unknown field"),   # schemes ignore case
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "wat": 1},
                    headers=key), 400, "unknown field 'wat'"),
        (httpx.post(url, json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, headers=key),
         404, "not served"),
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "robot", "content": "hi"}]}, headers=key),
         400, "role"),
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": 2},
                    headers=key), 400, "n=1"),
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": "x" * 70000}]},
                    headers=key), 413, "at most 65536 bytes"),
        (httpx.post(url, content=iter([b"x" * 40000] * 2), headers=key | {"content-type": "application/json"}),
         413, "at most 65536 bytes"),                                   # chunked: no length to refuse it by
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": DOC * 2}]},
                    headers=key, timeout=120), 400, "at most 600"),
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": DOC * 2}], "stream": True},
                    headers=key, timeout=120), 400, "at most 600"),       # a status, not a 200 and an error event
        (httpx.post(url, json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70},
                    headers=key), 400, "seed"),
        (httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": [5, 10**9], "stream": True},
                    headers=key), 400, "token id 1000000000 is not in the model's vocabulary"),
        (httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": [5, -1]}, headers=key),
         400, "token id -1"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    ok = httpx.post(url, json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                    headers=key, timeout=120)
    assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] <= 2
    assert httpx.get(f"{server.url}/v1/zz12345", headers=key).status_code == 404
    metrics = httpx.get(f"{server.url}/metrics").text      # a path a client made up is no series of its own
    assert 'endpoint="other"' in metrics and "zz12345" not in metrics
    assert 'endpoint="/v1/chat/completions"' in metrics


def test_a_run_beside_the_server_shares_its_store(launch, tmp_path):
    """Two processes on one store: `tierkv run` finds the document the server stored, and both answer alike."""
    import subprocess
    import sys
    store = tmp_path / "store"
    server = launch("--nvme-dir", str(store), *SMALL)
    served = ask(client(server), "Where was the second shop?")
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    done = subprocess.run([sys.executable, "-m", "tierkv.cli", "run", "--doc", str(doc), "--question",
                           "Where was the second shop?", "--max-new-tokens", "8", "--nvme-dir", str(store),
                           *SMALL, "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["reused_prompt_tokens"] > 0                      # found what the server stored
    assert result["text"] == served.choices[0].message.content
    server.settled()


def test_a_whole_answer_s_client_that_hangs_up_during_its_prefill_stops_the_work(launch, tmp_path):
    """Not streamed, the server writes nothing until the answer is whole: the handler watches for the
    client leaving, and the work stops at the prompt's next chunk, not once a 20K-token prefill and its
    answer are done."""
    server = launch("--nvme-dir", str(tmp_path / "store"), *SMALL)
    body = {"model": "smollm2", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": DOC * 40}, {"role": "user", "content": "Summarize."}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=2,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    server.settled()
    assert "tierkv_cancelled_total 1.0" in httpx.get(f"{server.url}/metrics").text
    assert "prompt tokens" not in server.log.read_text()         # no answer was finished and logged


def test_a_server_stopped_with_a_request_running_and_one_waiting_exits_cleanly(launch, tmp_path):
    server = launch("--nvme-dir", str(tmp_path / "store"), "--drain-s", "1", *SMALL)
    import threading
    long = {"model": "smollm2", "stream": True, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": DOC * 40}, {"role": "user", "content": "Summarize."}]}
    short = {"model": "smollm2", "stream": True, "max_tokens": 8, "temperature": 0,
             "messages": [{"role": "user", "content": "Hello."}]}
    outcomes: list[str] = []

    def stream(body: dict) -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                for _ in response.iter_lines():
                    pass
            outcomes.append("closed")
        except httpx.HTTPError as error:
            outcomes.append(type(error).__name__)
    clients = [threading.Thread(target=stream, args=(body,)) for body in (long, short)]   # one runs, one waits
    for c in clients:
        c.start()
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while not (server.health()["busy"] and server.health()["queue"] == 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    stalled = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))   # its body never comes
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"mo")
    time.sleep(0.5)
    assert server.stop() == 0, server.log.read_text()
    for c in clients:
        c.join(30)
    assert len(outcomes) == 2 and "Traceback" not in server.log.read_text()
    stalled.settimeout(10)
    told = stalled.recv(4096).decode()
    assert told.startswith("HTTP/1.1 503") and "body had not all arrived" in told, told
    assert "tierkv serve: stopped" in server.log.read_text()
    again = launch("--nvme-dir", str(tmp_path / "store"), *SMALL)              # the store opens as it was left
    assert ask(client(again), "Who founded the bakery?", max_tokens=2).usage.completion_tokens <= 2


@pytest.mark.parametrize("drain, signals", [("30", 1), ("0", 1), ("30", 2)])
def test_a_stream_running_when_the_server_is_told_to_stop_ends_whole_or_says_it_was_cut(launch, tmp_path, drain,
                                                                                        signals):
    """SIGTERM mid-answer: the server stops listening and lets the answer finish (--drain-s); past the
    drain, or at a second signal, it ends the stream with an error event, never as if it were whole."""
    import signal
    server = launch("--nvme-dir", str(tmp_path / "store"), "--drain-s", drain, *SMALL)
    body = {"model": "smollm2", "stream": True, "max_tokens": 24 if signals == 1 and drain == "30" else 400,
            "temperature": 0,
            "messages": [{"role": "user", "content": DOC}, {"role": "user", "content": "Tell the story again."}]}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) in (3, 6)[:signals]:
                    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=90) == 0
    log = server.log.read_text()
    assert "stopping: answers in progress may take" in log and "tierkv serve: stopped" in log
    assert "Traceback" not in log and ("stopping now" in log) == (signals == 2)
    whole = events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    if drain == "30" and signals == 1:      # finished within the drain: whole, as OpenAI ends a stream
        assert whole
    elif not whole:                         # cut (or, had it ended meanwhile, whole): never silently
        error = json.loads(events[-1])["error"]
        assert "shutting down" in error["message"] and error["code"] == "server_shutdown"


async def test_events_already_there_are_delivered_after_the_drain_ended():
    """An answer done before the drain ended, whose client read slowly, is delivered whole: only the
    wait for more is cut."""
    import asyncio

    from tierkv.serve.app import Closing, _results
    from tierkv.serve.worker import Job
    job = Job("completion", "hi", None, asyncio.get_running_loop())
    for event in [("text", "a"), ("text", "b"), ("done", None)]:
        job.events.put_nowait(event)
    closing = Closing(0.0)
    closing.begin()
    await asyncio.sleep(0.01)
    assert [kind async for kind, _ in _results(job, closing)] == ["text", "text", "done"]
    waiting = Job("completion", "hi", None, asyncio.get_running_loop())
    with pytest.raises(Exception, match="shutting down"):
        await anext(_results(waiting, closing))


async def test_a_connection_whose_headers_do_not_come_is_a_408_and_closed(monkeypatch):
    """uvicorn waited for a request's headers for ever: a client that connected and sent nothing, or half
    a request line, held its connection. A real uvicorn server on a real socket, with ``HeadersInTime``."""
    import asyncio

    import uvicorn

    from tierkv.serve import guard as served
    monkeypatch.setattr(served, "HEADERS_S", 0.5)

    async def app(scope, receive, send):           # an answer that takes longer than the headers may
        if scope["path"] != "/early":
            await asyncio.sleep(1.0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    servers = []

    async def serve(keep_alive: float) -> int:      # (keep_alive: uvicorn closes an idle line after an answer)
        server = uvicorn.Server(uvicorn.Config(app, http=served.HeadersInTime, lifespan="off", log_level="warning",
                                               timeout_keep_alive=keep_alive))
        listener = socket.create_server(("127.0.0.1", 0))
        servers.append((server, asyncio.create_task(server.serve(sockets=[listener]))))
        while not server.started:
            await asyncio.sleep(0.05)
        return listener.getsockname()[1]

    async def told(port: int, *sends: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for data in sends:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.1)
        got = await asyncio.wait_for(reader.read(), 10)       # to the server's close
        writer.close()
        return got
    try:
        short, long = await serve(0.2), await serve(60)
        assert (await told(short)).startswith(b"HTTP/1.1 408")                            # nothing sent
        assert (await told(short, b"GET / HT")).startswith(b"HTTP/1.1 408")               # half a request line
        answered = await told(short, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HTTP/1.1\r\nHo")
        assert answered.startswith(b"HTTP/1.1 200") and answered.count(b"HTTP/1.1 ") == 2    # then a half one
        assert answered.split(b"HTTP/1.1 ")[2].startswith(b"408")
        pipelined = await told(short, b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HT")  # one packet: the idle timer
        assert pipelined.count(b"HTTP/1.1 ") == 2 and pipelined.split(b"HTTP/1.1 ")[2].startswith(b"408")  # not
        idle = await told(short, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")              # its silent close
        assert idle.startswith(b"HTTP/1.1 200") and idle.count(b"HTTP/1.1 ") == 1
        # a request answered before its body came (as a 401 is): closed in time, not given a 408 after its answer
        unread = await told(long, b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nxy")
        assert unread.startswith(b"HTTP/1.1 200") and unread.count(b"HTTP/1.1 ") == 1
    finally:
        for server, task in servers:
            server.should_exit = True
            await asyncio.wait_for(task, 10)


async def test_a_body_that_stops_arriving_is_a_408_and_the_app_never_sees_it(monkeypatch):
    import asyncio

    from fastapi import FastAPI

    from tierkv.serve import guard as served
    from tierkv.serve.app import Closing
    from tierkv.serve.metrics import Metrics
    monkeypatch.setattr(served, "BODY_IDLE_S", 0.5)
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.extend([await receive(), await receive()])

    started = []

    async def stalls():
        if not started:
            started.append(True)
            return {"type": "http.request", "body": b'{"mo', "more_body": True}
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)
    guard = served.Guard(app, metrics=Metrics(), api_key=None, max_body_bytes=1 << 20, routes=FastAPI(),
                         closing=Closing(0.0))
    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
    await asyncio.wait_for(guard(scope, stalls, send), 5)
    assert not reached and sent[0]["status"] == 408 and b"stopped arriving" in sent[1]["body"]
    pieces = iter([{"type": "http.request", "body": b'{"a":', "more_body": True},
                   {"type": "http.request", "body": b' 1}', "more_body": False}, {"type": "http.disconnect"}])

    async def arrives():
        return next(pieces)
    await guard(scope, arrives, send)             # a body in pieces reaches the app whole, then the hang-up
    assert reached == [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}, {"type": "http.disconnect"}]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_server_told_to_stop_while_its_model_loads_stops_at_once(tmp_path, sig):
    port = free_port()
    log = tmp_path / "serve.log"
    process = subprocess.Popen([sys.executable, str(Path(__file__).parent / "slow_load.py"), "--port", str(port)],
                               stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 503:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError(log.read_text())
        started = time.monotonic()
        process.send_signal(sig)
        assert process.wait(timeout=30) == 0 and time.monotonic() - started < 10      # not after the load's 60 s
        assert "stopping (the model had not finished loading)" in log.read_text()
    finally:
        process.kill()


def test_a_store_that_cannot_be_used_stops_the_start_not_every_request(launch, tmp_path, tiny_model_dir):
    """A broken store used to let the server start, say it was healthy, and answer every request
    with a 400 that blamed the request (the store opened at the first one)."""
    store = tmp_path / "s"
    server = launch("--model", str(tiny_model_dir), "--nvme-dir", str(store))
    assert server.stop() == 0
    broken = sorted(store.glob("*/store.json"))
    assert len(broken) == 2                        # the dense and the sparse store: both opened at the start
    broken[0].write_text('{"format": "tierkv-nvme", "version": 9}')       # (a damaged one is rebuilt: no block)
    with pytest.raises(AssertionError, match=r"(?s)tierkv serve exited 2: .*this tierkv reads 'tierkv-nvme' v1"):
        launch("--model", str(tiny_model_dir), "--nvme-dir", str(store))


def test_a_prompt_the_tiers_cannot_hold_is_the_client_s_400_and_the_operator_s_log_line(launch, tmp_path,
                                                                                       tiny_model_dir):
    """Without a store, the tiers' budgets bound a prompt: one past them was a 500 that told the
    client to raise the server's budgets."""
    server = launch("--model", str(tiny_model_dir), "--mode", "dense", "--gpu-budget", "64KiB",
                    "--cpu-budget", "64KiB", "--served-name", "tiny")
    key = {"Authorization": f"Bearer {API_KEY}"}
    for stream in (False, True):         # streamed: its headers went before the prompt ran; an error event
        refused = httpx.post(f"{server.url}/v1/completions", headers=key, timeout=120,
                             json={"model": "tiny", "prompt": list(range(5, 1500)), "max_tokens": 2, "stream": stream})
        assert refused.status_code == (200 if stream else 400), refused.text
        error = json.loads(refused.text.removeprefix("data: "))["error"]
        assert error["code"] == "context_length_exceeded" and "budget" not in error["message"]
        assert "more KV than this server's tiers hold" in error["message"]
    ok = httpx.post(f"{server.url}/v1/completions", headers=key, timeout=120,
                    json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert server.stop() == 0
    assert "raise its budget" in server.log.read_text()


def test_a_full_disk_is_a_507_that_names_no_path_and_the_server_goes_on(launch, tiny_tmpfs, tiny_model_dir):
    server = launch("--model", str(tiny_model_dir), "--mode", "dense", "--gpu-budget", "64KiB",
                    "--cpu-budget", "64KiB", "--nvme-dir", str(tiny_tmpfs / "store"), "--served-name", "tiny")
    key = {"Authorization": f"Bearer {API_KEY}"}
    full = httpx.post(f"{server.url}/v1/completions", headers=key, timeout=120,
                      json={"model": "tiny", "prompt": list(range(5, 12000)), "max_tokens": 2})
    assert full.status_code == 507, full.text
    assert "out of disk space" in full.json()["error"]["message"] and str(tiny_tmpfs) not in full.text
    ok = httpx.post(f"{server.url}/v1/completions", headers=key, timeout=120,
                    json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert server.stop() == 0
    assert "no space left" in server.log.read_text()


def test_parallel_requests_answer_side_by_side_and_one_that_does_not_fit_beside_runs_again_alone(launch,
                                                                                               tiny_model_dir):
    """--parallel 2 without a store: a short request is answered while a long one streams, and one whose
    KV the tiers hold only alone (all 6 of their blocks) waits for the long one and then runs, where it was
    a 400 "too long" though it fits the server."""
    server = launch("--model", str(tiny_model_dir), "--mode", "dense", "--dtype", "float32", "--parallel", "2",
                    "--gpu-budget", "192KiB", "--cpu-budget", "192KiB", "--served-name", "tiny")
    key, url = {"Authorization": f"Bearer {API_KEY}"}, f"{server.url}/v1/completions"

    def complete(prompt: list[int], max_tokens: int) -> httpx.Response:
        return httpx.post(url, headers=key, timeout=120, json={"model": "tiny", "prompt": prompt,
                                                               "max_tokens": max_tokens, "temperature": 0})
    short, big = [5, 6, 7], list(range(5, 785))    # 780 tokens: 3 blocks a layer, all the tiers hold
    import threading
    streaming, done = threading.Event(), {}

    def long() -> None:                            # one block a layer for its whole answer
        with httpx.stream("POST", url, headers=key, timeout=120, json={
                "model": "tiny", "prompt": list(range(2000, 2260)), "max_tokens": 250, "temperature": 0,
                "stream": True}) as response:
            for line in filter(None, response.iter_lines()):
                streaming.set()
                done["last"] = line
        done["ended"] = True
    reader = threading.Thread(target=long)
    reader.start()
    assert streaming.wait(60)
    beside = complete(short, 2)
    held_up = "ended" in done                      # the short answer came after the long one
    got = {}
    waiting = threading.Thread(target=lambda: got.update(fitted=complete(big, 2)))
    waiting.start()
    deadline = time.monotonic() + 60
    while "runs again alone" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "ended" not in done                     # sent while the long answer runs and the big one waits
    later = complete([8, 9, 10, 11], 2)
    waiting.join(60)
    reader.join(60)
    fitted = got["fitted"]
    assert beside.status_code == 200 and fitted.status_code == 200 and later.status_code == 200, fitted.text
    assert not held_up and done["last"] == "data: [DONE]" and server.health()["running"] == 0
    assert "tierkv_requests_running 0.0" in httpx.get(f"{server.url}/metrics").text
    log = server.log.read_text()
    assert "did not fit the tiers beside the others': it runs again alone" in log
    assert log.index("250 tokens") < log.index("780 prompt tokens (0 stored)")   # alone: after the long one
    assert log.index("780 prompt tokens (0 stored)") < log.index(" 4 prompt tokens")    # not overtaken by one after
    assert complete(big, 2).json()["choices"] == fitted.json()["choices"]

    done.clear(), streaming.clear()                # a client that leaves while its request waits to run alone
    reader = threading.Thread(target=long)
    reader.start()
    assert streaming.wait(60)
    with httpx.stream("POST", url, headers=key, timeout=120, json={"model": "tiny", "prompt": list(range(5, 790)),
                                                                  "max_tokens": 2, "stream": True}):
        while server.log.read_text().count("runs again alone") < 2 and time.monotonic() < deadline + 60:
            time.sleep(0.02)
    freed = complete([8, 9, 10, 11, 12], 2)       # its thread is free again: not held up behind the long answer
    held_up = "ended" in done
    reader.join(60)
    assert freed.status_code == 200 and not held_up and "785 prompt tokens" not in server.log.read_text()
    assert server.stop() == 0
