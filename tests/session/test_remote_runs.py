"""Prefill once, decode anywhere: runs with empty local stores share KV through a real redis-server, and a
remote that dies or serves damaged bytes never changes the text."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierkv.model.settings import RunConfig
from tierkv.session.run import run

pytestmark = pytest.mark.model
DENSE = dict(synthetic_tokens=1200, block_tokens=128, chunk_tokens=256, max_new_tokens=8, mode="dense",
             gpu_budget="64MiB", cpu_budget="64MiB")


def cli_run(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tierkv.cli", "run", *args, "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_second_process_with_an_empty_store_decodes_from_the_first_ones_prefill(redis_server, tmp_path):
    flags = ["--synthetic-tokens", "1200", "--block-tokens", "128", "--chunk-tokens", "256", "--max-new-tokens",
             "8", "--mode", "dense", "--remote", redis_server.url]
    first = cli_run(*flags, "--nvme-dir", str(tmp_path / "a"))
    second = cli_run(*flags, "--nvme-dir", str(tmp_path / "b"))
    assert first["reused_prompt_tokens"] == 0 and first["remote"]["written"] > 0
    assert second["reused_prompt_tokens"] == 1152                    # every whole block but the last token's
    assert second["remote"]["hits"] == 9 * 30 and second["remote"]["corrupt"] == 0
    assert second["text"] == first["text"] and second["found"]


def test_a_remote_killed_mid_run_changes_nothing(smollm2, redis_server):
    reference = run(RunConfig.of(**DENSE), loaded=smollm2)
    killed = []

    def kill_once(done: int, total: int) -> None:
        if not killed:
            killed.append(done)
            redis_server.kill()
    got = run(RunConfig.of(**DENSE, remote=redis_server.url), loaded=smollm2, on_prefill=kill_once)
    assert killed and got.text == reference.text
    assert got.remote["errors"] >= 1 and got.remote["written"] < 9 * 30      # writes stopped at the kill


def test_a_damaged_remote_block_is_detected_and_recomputed(smollm2, redis_server):
    first = run(RunConfig.of(**DENSE, remote=redis_server.url), loaded=smollm2)
    client = redis_server.client()
    names = sorted(client.keys(b"tierkv:*:b:*"))
    assert len(names) == first.remote["written"] > 0
    for name in names[::7]:                                    # flip a byte in every 7th block
        value = bytearray(client.get(name))
        value[len(value) // 2] ^= 0x10
        client.set(name, bytes(value))
    second = run(RunConfig.of(**DENSE, remote=redis_server.url), loaded=smollm2)
    assert second.remote["corrupt"] >= 1
    assert second.reused_prompt_tokens < first.prompt_tokens - 128     # not all of it: a block had to be redone
    assert second.text == first.text


def test_a_sparse_state_moves_to_an_empty_store_through_the_remote(smollm2, redis_server, tmp_path):
    sparse = dict(DENSE, mode="sparse", sparse_budget=256)
    first = run(RunConfig.of(**sparse, remote=redis_server.url, nvme_dir=tmp_path / "a"), loaded=smollm2)
    client = redis_server.client()
    shared = [n.decode() for key in client.keys(b"tierkv:*:files") for n in client.smembers(key)]
    assert len(shared) == 1 and shared[0].split("-")[1] == "1199"        # the index of the 1199 document tokens
    second = run(RunConfig.of(**sparse, remote=redis_server.url, nvme_dir=tmp_path / "b"), loaded=smollm2)
    assert second.reused_prompt_tokens == first.prompt_tokens - 1
    assert second.remote["hits"] > 0 and second.remote["corrupt"] == 0
    assert second.text == first.text
