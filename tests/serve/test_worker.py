"""The line of requests waiting for the server's worker (tierkv.serve.worker.Waiting)."""
import asyncio
import threading
import time

import pytest

from tierkv.serve.worker import Job, QueueFull, Waiting
from tierkv.session import Sampling


def job() -> Job:
    return Job("completion", [1], Sampling(), asyncio.new_event_loop())


def test_a_request_whose_client_left_holds_no_place_in_the_line():
    line, first, second = Waiting(2), job(), job()
    line.put(first)
    line.put(second)
    with pytest.raises(QueueFull, match="2 requests are waiting already"):
        line.put(job())
    first.cancel()                      # its client timed out while it waited
    assert len(line) == 1
    third = job()
    line.put(third)
    assert [line.get(), line.get()] == [second, third]


def test_the_worker_waits_for_a_request_and_stops_after_those_waiting():
    line, got = Waiting(4), []
    thread = threading.Thread(target=lambda: got.extend(iter(line.get, None)))
    thread.start()
    jobs = [job(), job()]
    for j in jobs:
        line.put(j)
    line.end()
    thread.join(timeout=10)
    assert got == jobs and not thread.is_alive()


def test_every_thread_of_the_worker_stops_at_the_end():
    line, got = Waiting(4), []
    threads = [threading.Thread(target=lambda: got.extend(iter(line.get, None))) for _ in range(3)]
    for thread in threads:
        thread.start()
    j = job()
    line.put(j)
    time.sleep(0.2)                     # every thread waits for the next request
    line.end()
    for thread in threads:
        thread.join(timeout=10)
    assert got == [j] and not any(thread.is_alive() for thread in threads)


def test_stopping_takes_every_request_waiting():
    line = Waiting(4)
    jobs = [job(), job()]
    for j in jobs:
        line.put(j)
    assert line.take_all() == jobs and len(line) == 0


def test_the_server_s_own_trouble_is_a_5xx_that_names_no_path_and_a_prompt_too_big_a_400():
    from tierkv.errors import BudgetExceeded, StoreUnusable
    from tierkv.serve.errors import as_api_error
    from tierkv.serve.worker import TiersTooSmall
    cases = [(StoreUnusable("NVMe store /srv/kv: its owner file was removed; reopen it"), 500, None),
             (BudgetExceeded("NVMe store /srv/kv: no free slot for this process"), 503, "server_busy"),
             (TiersTooSmall("tier cpu: all 2 slots are pinned; raise its budget"), 400, "context_length_exceeded")]
    for error, status, code in cases:
        api = as_api_error(error)
        assert (api.status, api.body["error"]["code"]) == (status, code)
        assert "/srv/kv" not in api.body["error"]["message"] and "budget" not in api.body["error"]["message"]
