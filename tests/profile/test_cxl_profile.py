"""A simulated CXL pool in traces, summaries and replay: link, queue and near-memory compute apart."""
from __future__ import annotations

import asyncio

import pytest
import torch

from policies.selectors import make_selector
from tierkv.config import TierConfig
from tierkv.knobs import IOKnobs
from tierkv.keys import BlockKey
from tierkv.manager.manager import TierManager
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import TierSpec, TraceMeta
from tierkv.events import EventRecorder
from tierkv.tune.replay import ReplayConfig, replay
from tierkv.tune.tier_model import Link, TierModel
from tierkv.profile.summary import summarize
from tierkv.profile.summary_text import format_summary
from tierkv.profile.trace import read_trace, write_trace
from tierkv.tiers.cxl_link import LINK_PRESETS

BLOCK = 4096
SLOW_POOL = dict(cxl_read_gbps=0.0002, cxl_write_gbps=0.05, cxl_latency_ns=2e5)   # reads 20 ms a block


def key(i: int) -> BlockKey:
    return BlockKey.of("cxl-profile", i)


async def pool_run(tmp_path) -> TierManager:
    """cpu (4 blocks) over a slow pool: puts spill into the pool, reads load back two at a time (they queue)."""
    cfg = TierConfig(block_bytes=BLOCK, gpu=0, cpu=4 * BLOCK, cxl=64 * BLOCK, **SLOW_POOL)
    m = await TierManager.from_config(cfg, knobs=IOKnobs(copy_threads=2, inflight_bytes=1 << 20)).start()
    for i in range(24):
        await m.put(key(i), torch.full((BLOCK,), i, dtype=torch.uint8))
    for i in range(8, 20, 2):
        leases = await asyncio.gather(m.acquire([key(i)], "cpu"), m.acquire([key(i + 1)], "cpu"))
        for lease in leases:
            lease.release()
    return m


async def test_trace_and_summary_show_link_and_queue_apart_from_transfers(tmp_path):
    m = await pool_run(tmp_path)
    try:
        write_trace(tmp_path / "run.json", m.events.events, m.events.origin)
    finally:
        await m.aclose()
    trace = read_trace(tmp_path / "run.json")
    s = summarize(trace.events, trace.meta, phase="all")
    rows = {(r.kind, r.where): r for r in s.modelled}
    assert {("link", "cpu->cxl"), ("link", "cxl->cpu"), ("link", "new->cxl")} <= set(rows)
    assert rows[("queue", "cxl->cpu")].count >= 1                    # two loads at once contended
    loads = [e for e in trace.events if e.kind == "load" and e.src == "cxl"]
    assert rows[("link", "cxl->cpu")].nbytes == sum(e.nbytes for e in loads)
    link_row = next(r for r in s.links if r.link == "cxl->cpu")
    assert link_row.nbytes == sum(e.nbytes for e in loads)             # not doubled by the link slices
    per_block = BLOCK / 0.0002e9 + 2e-4
    assert rows[("link", "cxl->cpu")].seconds >= per_block * len(loads) * 0.99
    text = format_summary(s)
    assert "CXL pool (modelled)" in text and "link cxl->cpu" in text
    names = {r["args"]["name"] for r in _metadata(tmp_path / "run.json")}
    assert {"link cxl->cpu", "cxl->cpu"} <= names


def test_near_memory_compute_is_its_own_slice_and_row(tmp_path):
    recorder = EventRecorder()
    selector = make_selector("near-memory", pnm="pnm-expander")
    selector.attach(recorder)
    g = torch.Generator().manual_seed(0)
    landmarks, query = torch.randn(4096, 4, 64, generator=g), torch.randn(8, 64, generator=g)
    view = type("View", (), {"layer": 5, "landmarks": landmarks, "candidates": torch.ones(4096, dtype=torch.bool),
                             "landmark_scale": None})
    for _ in range(3):
        selector.select(query, view, 64)
    write_trace(tmp_path / "nm.json", recorder.events, recorder.origin)
    s = summarize(read_trace(tmp_path / "nm.json").events, phase="all")
    rows = {(r.kind, r.where): r for r in s.modelled}
    assert rows[("compute", "cxl")].count == 3
    assert rows[("compute", "cxl")].seconds == pytest.approx(selector.stats["compute_s"], rel=0.05)
    assert rows[("link", "host->cxl")].nbytes == 4096 * 4 * 64 * 4 + 512 + 3 * query.nbytes
    assert rows[("link", "cxl->host")].nbytes == 3 * 4 * 64 * 4
    assert "near-memory compute cxl" in format_summary(s)


def test_replay_prices_the_pool_by_its_link_model():
    rec = AccessRecorder()
    meta = TraceMeta(BLOCK, (TierSpec("cpu", "cpu", 4), TierSpec("cxl", "cxl", 64)))
    rec.begin_step("decode", 1)
    for i in range(16):
        rec.on_put(key(i), 0)
    for i in range(16):
        rec.on_acquire([key(i)], 0)
    trace = rec.trace(meta=meta)
    result = replay(trace, TierModel({"*->*": Link(100.0)}), ReplayConfig(prefetch="none", cxl_preset="cmm-b"))
    spec = LINK_PRESETS["cmm-b"]
    loads = result.bytes_by_link["cxl->cpu"] // BLOCK
    assert result.pool_s["link cxl->cpu"] == pytest.approx(loads * (BLOCK / (spec.read_gbps * 1e9)
                                                                     + spec.latency_ns * 1e-9), rel=1e-6)
    explicit = TierModel({"*->*": Link(100.0), "cxl->*": Link(1.0)})   # a model naming the pool wins
    assert explicit.with_pool("cxl", spec) is explicit


def _metadata(path):
    import json
    return [r for r in json.loads(path.read_text())["traceEvents"] if r.get("name") == "thread_name"]
