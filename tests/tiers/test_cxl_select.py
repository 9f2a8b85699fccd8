"""The near-memory selector: the same chunks as host-side selection, only ids and queries cross the link."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from policies.selectors import make_selector, selectors
from tierkv.errors import ConfigError
from tierkv.events import EventRecorder
from tierkv.scoring import landmark_scores, top_chunks
from tierkv.tiers.cxl_link import Direction, LinkSpec
from tierkv.tiers.cxl_pnm import INDEX_BYTES, NearMemoryProcessor, PnmSpec, Work, pnm_spec


@dataclass
class View:
    layer: int
    landmarks: torch.Tensor | None
    candidates: torch.Tensor
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    landmark_scale: torch.Tensor | None = None


def host_select(query, view, k):
    return top_chunks(landmark_scores(query, view.landmarks), k, view.candidates)


def growing_views(layer, chunks, kv_heads, head_dim, dtype, g):
    """Views of one layer as a sequence grows: append-only rows, the last one still filling."""
    full = torch.randn(chunks[-1], kv_heads, head_dim, generator=g).to(dtype)
    cand = torch.rand(chunks[-1], generator=g) > 0.1
    for n in chunks:
        rows = full[:n].clone()
        rows[-1] += 0.5  # the chunk being filled differs from its final value
        yield View(layer, rows, cand[:n].clone())


@pytest.mark.parametrize("kv_heads,group,head_dim,dtype", [
    (3, 3, 64, torch.float32), (4, 4, 64, torch.bfloat16), (1, 1, 32, torch.float16), (2, 7, 64, torch.float32)])
def test_same_chunks_as_host_selection(kv_heads, group, head_dim, dtype):
    g = torch.Generator().manual_seed(kv_heads * 100 + group)
    selector = make_selector("near-memory")
    for layer in range(2):
        for view in growing_views(layer, [1, 5, 64, 65, 700, 1501], kv_heads, head_dim, dtype, g):
            query = torch.randn(kv_heads * group, head_dim, generator=g).to(dtype)
            for k in (0, 1, 7, 128, 5000):
                got = selector.select(query, view, k)
                assert torch.equal(got, host_select(query, view, k)), (layer, view.landmarks.shape, k)


def test_ties_and_outliers_pick_the_same_ids():
    selector = make_selector("near-memory")
    landmarks = torch.ones(300, 2, 16)                   # every chunk scores the same
    candidates = torch.arange(300) % 3 != 0               # outliers kept exact elsewhere
    view = View(0, landmarks, candidates)
    query = torch.ones(4, 16)
    assert torch.equal(selector.select(query, view, 50), host_select(query, view, 50))


def test_only_new_rows_queries_and_ids_cross_the_link():
    selector = make_selector("near-memory")
    stats = selector.processor.link.stats
    g = torch.Generator().manual_seed(1)
    landmarks = torch.randn(1000, 4, 64, generator=g)     # 1 KiB per row
    cand = torch.ones(1000, dtype=torch.bool)
    query = torch.randn(8, 64, generator=g)
    selector.select(query, View(0, landmarks[:800], cand[:800]), 32)
    assert stats.nbytes[Direction.WRITE] == 800 * 1024 + 100 + query.nbytes
    assert stats.nbytes[Direction.READ] == 4 * 32 * INDEX_BYTES
    before = stats.nbytes[Direction.WRITE]
    selector.select(query, View(0, landmarks[:800], cand[:800]), 32)      # nothing new: query only
    assert stats.nbytes[Direction.WRITE] - before == query.nbytes
    before = stats.nbytes[Direction.WRITE]
    selector.select(query, View(0, landmarks, cand), 32)                   # 200 new rows and their bits
    assert stats.nbytes[Direction.WRITE] - before == 200 * 1024 + 25 + query.nbytes
    assert selector.stats["selections"] == 3 and selector.stats["mirrored_bytes"] == 1000 * 1024 + 125


@pytest.mark.serial
def test_a_selection_costs_the_modelled_time_and_commands_queue():
    slow = PnmSpec(scan_gbps=0.5, tflops=1.0, select_gcmps=100.0, launch_us=1000.0)
    processor = NearMemoryProcessor(LinkSpec(50.0, 50.0, 0.0), slow, recorder=EventRecorder())
    landmarks = torch.randn(4096, 4, 128)                 # 8 MiB of landmarks: 16.8 ms to scan
    processor.store(0, landmarks, torch.ones(4096, dtype=torch.bool))
    query = torch.randn(16, 128)
    work = Work.of(4096, 4, 128, 16, 4, 64)
    modelled = slow.seconds(work.scanned, work.flops, work.compares)
    start = time.perf_counter()
    processor.select(0, query, 64)
    assert modelled <= time.perf_counter() - start <= modelled * 1.2 + 0.05
    ends = []
    threads = [threading.Thread(target=lambda: (processor.select(0, query, 64), ends.append(time.perf_counter())))
               for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(ends) - start >= 2 * modelled - 2e-3           # one command at a time
    assert {"compute", "link"} <= {e.kind for e in processor.recorder.events}
    first, second = processor.reserve(0.05), processor.reserve(0.01)   # booked at once: the second waits
    assert second[1] == pytest.approx(first[2], abs=1e-9) and second[2] - second[1] == pytest.approx(0.01)


def test_registry_and_bad_input():
    assert "near-memory" in selectors()
    with pytest.raises(ConfigError, match="pnm='fast'.*pnm-ocp25"):
        pnm_spec("fast")
    with pytest.raises(ConfigError, match="scan_gbps=0.*> 0"):
        PnmSpec(0, 1.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="cxl_preset='x9'"):
        make_selector("near-memory", link="x9")
    with pytest.raises(ValueError, match="layer 3.*landmarks"):
        make_selector("near-memory").select(torch.ones(2, 4), View(3, None, torch.ones(2, dtype=torch.bool)), 1)
