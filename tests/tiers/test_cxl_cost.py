"""The decode-step cost model behind bench/cxl.py: sizes per layer and where (a) and (b) break even."""
from __future__ import annotations

import pytest

from tierkv.errors import ConfigError
from tierkv.tiers.cxl_cost import (GEOMETRIES, Geometry, Layer, break_even_budget, break_even_context,
                                   break_even_scan_gbps, step_costs)
from tierkv.tiers.cxl_link import LINK_PRESETS, LinkSpec
from tierkv.tiers.cxl_pnm import PNM_PRESETS, PnmSpec

G = Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=64)
X8, PNM = LINK_PRESETS["cxl2-x8"], PNM_PRESETS["pnm-ocp25"]


def test_sizes_per_layer() -> None:
    layer = Layer.of(G, 8192, 0.02)                        # 1024 chunks, k = 21
    assert layer.landmarks == 1024 * 2 * 64 * 2
    assert layer.values == 2 * 21 * 8 * 64 * 2
    assert (layer.query, layer.ids) == (4 * 64 * 2, 2 * 21 * 4)
    assert layer.pages(G) == 2 * 21 * 4096                 # 1 KiB of values per chunk and head: a page each
    with pytest.raises(ConfigError, match="budget=0"):
        Layer.of(G, 8192, 0)


def test_what_crosses_the_link() -> None:
    c = step_costs(G, 8192, 0.02, X8, PNM)
    layer = Layer.of(G, 8192, 0.02)
    assert c["pool-host"].link_bytes == 2 * (layer.landmarks + layer.values)
    assert c["pool-near"].link_bytes == 2 * (layer.query + layer.ids + layer.values)
    assert c["local"].link_bytes == 0 and c["pool-values"].link_bytes == 2 * layer.values


def test_break_even_points_agree_with_the_step_times() -> None:
    g = GEOMETRIES["smollm2-135m"]
    assert break_even_budget(g, 1 << 20, X8, PNM) is None          # near-memory wins at every budget
    weak = PnmSpec(scan_gbps=20.0, tflops=1.0, select_gcmps=8.0, launch_us=10.0)   # scans slower than x8 reads
    assert break_even_budget(g, 1 << 20, X8, weak) == pytest.approx(1e-4)
    ctx = break_even_context(g, 0.02, X8, PNM)
    costs = [step_costs(g, c, 0.02, X8, PNM) for c in (ctx // 2, ctx)]
    assert costs[0]["pool-host"].seconds <= costs[0]["pool-near"].seconds
    assert costs[1]["pool-host"].seconds > costs[1]["pool-near"].seconds
    gbps = break_even_scan_gbps(g, 1 << 20, 0.02, X8, PNM)
    assert 0.8 * X8.read_gbps < gbps < 1.5 * X8.read_gbps          # it must outrun the link, about
    slow_compute = PnmSpec(200.0, 0.001, 8.0, 10.0)
    assert break_even_scan_gbps(g, 1 << 20, 0.02, LinkSpec(56.0, 56.0, 250.0), slow_compute) is None
