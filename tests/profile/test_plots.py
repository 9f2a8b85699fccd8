"""Profile plots render to a PNG from synthetic events, with and without decode steps or stalls."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tierkv.errors import ConfigError
from tierkv.events import Event
from tierkv.profile.plots import check_plot_path, plot_profile, timeline_window
from tierkv.profile.summary import summarize

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (pip install 'tierkv-runtime[profile]')")

MiB = 2**20
MS = 1e-3
PNG = b"\x89PNG\r\n\x1a\n"


def ev(kind: str, start: float, done: float, src: str = "", dst: str = "", layer: int | None = None,
       nbytes: int = 0, blocks: int = 1) -> Event:
    return Event(kind, src, dst, layer, nbytes, start, start, done, blocks)


def decode(steps: int = 6, layers: int = 8, slow_step: int = 3) -> list[Event]:
    """Steps of ``layers`` layers; layer 5 waits on an nvme->gpu load (longer in ``slow_step``), layer 2
    on a late cpu->gpu prefetch; a demote gpu->cpu and a writeback run beside them."""
    events, t = [], 0.0
    for s in range(steps):
        step_start = t
        for layer in range(layers):
            layer_start = t
            events.append(ev("prefetch", t, t + 4 * MS, "nvme", "gpu", layer + 1, MiB))
            if layer == 5:
                wait = (30 if s == slow_step else 10) * MS
                events += [ev("load", t, t + wait, "nvme", "gpu", layer, 2 * MiB, 2),
                           ev("demote", t, t + 2 * MS, "gpu", "cpu", None, MiB),
                           ev("wait", t, t + wait, "", "gpu", layer, 2 * MiB, 2)]
                t += wait
            if layer == 2:
                events += [ev("prefetch", t - 1 * MS, t + 3 * MS, "cpu", "gpu", layer, MiB),
                           ev("wait", t, t + 3 * MS, "", "gpu", layer, MiB)]
                t += 3 * MS
            events.append(ev("writeback", t, t + 6 * MS, "cpu", "nvme", None, MiB))
            t += 4 * MS
            events.append(ev("layer", layer_start, t, layer=layer))
        events.append(ev("step", step_start, t))
        t += 0.5 * MS
    return events


def render(events: list[Event], path: Path, **kw) -> bytes:
    plot_profile(events, summarize(events), path, **kw)
    return path.read_bytes()


@needs_matplotlib
def test_renders_a_png(tmp_path: Path) -> None:
    data = render(decode(), tmp_path / "p.png")
    assert data.startswith(PNG) and len(data) > 20_000


def test_timeline_shows_the_slowest_step_and_its_neighbours() -> None:
    events = decode(slow_step=3)
    steps = sorted((e for e in events if e.kind == "step"), key=lambda e: e.start)
    start, end, label = timeline_window(events, 3)
    assert (start, end) == (steps[2].start, steps[4].done)
    assert "step 4 is the slowest" in label
    start, end, _ = timeline_window(decode(slow_step=5), 3)   # the last step: window ends there
    assert end == max(e.done for e in decode(slow_step=5) if e.kind == "step")


@needs_matplotlib
def test_renders_without_steps_or_without_stall(tmp_path: Path) -> None:
    no_steps = [e for e in decode() if e.kind != "step"]
    assert render(no_steps, tmp_path / "a.png").startswith(PNG)
    _, _, label = timeline_window(no_steps, 3)
    assert "no decode steps" in label
    no_stall = [e for e in decode() if e.kind != "wait"]
    assert render(no_stall, tmp_path / "b.png", steps=1).startswith(PNG)


def test_without_matplotlib_plotting_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'tierkv-runtime\[profile\]'"):
        render(decode(), tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_a_plot_path_matplotlib_cannot_write_is_refused_before_the_work(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    check_plot_path(tmp_path / "p.png")
    check_plot_path(tmp_path / "p.SVG")
    with pytest.raises(ConfigError, match=r"--plot .*/p.txt: give a file name ending in a format .*\.pdf.*\.png"):
        check_plot_path(tmp_path / "p.txt")
    with pytest.raises(ConfigError, match="give a file name ending in"):
        check_plot_path(tmp_path / "p")
    (tmp_path / "d.png").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        check_plot_path(tmp_path / "d.png")
