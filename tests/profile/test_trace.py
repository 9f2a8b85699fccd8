"""Trace files: what ``tierkv run --trace`` writes reads back, renders as clean tracks, and fails clearly."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tierkv.errors import ConfigError
from tierkv.events import Event
from tierkv.profile.trace import VERSION, chrome_trace, profiler_range, read_trace, write_trace

ORIGIN = 100.0
MiB = 2**20


def ev(kind: str, start: float, done: float, src: str = "", dst: str = "", layer: int | None = None,
       nbytes: int = 0, blocks: int = 1, submit: float | None = None, error: str = "") -> Event:
    t = ORIGIN + start
    return Event(kind, src, dst, layer, nbytes, ORIGIN + (start if submit is None else submit), t,
                 ORIGIN + done, blocks, error)


def one_step() -> list[Event]:
    """One decode step of two layers; two overlapping loads on one link; a wait on the second."""
    return [
        ev("step", 0.000, 0.010),
        ev("layer", 0.000, 0.004, layer=0),
        ev("layer", 0.004, 0.010, layer=1),
        ev("prefetch", 0.001, 0.006, "nvme", "gpu", 1, 2 * MiB, 2, submit=0.0005),
        ev("load", 0.002, 0.007, "nvme", "gpu", 1, MiB, 1),
        ev("wait", 0.004, 0.007, "", "gpu", 1, MiB),
        ev("writeback", 0.003, 0.004, "cpu", "nvme", None, MiB, error="DiskFullError"),
        ev("hit", 0.004, 0.004, "gpu", "gpu", 1, 3 * MiB, 3),
    ]


def slices(trace: dict) -> list[dict]:
    return [r for r in trace["traceEvents"] if r["ph"] == "X"]


def track_names(trace: dict) -> dict[int, str]:
    return {r["tid"]: r["args"]["name"] for r in trace["traceEvents"] if r["name"] == "thread_name"}


def test_round_trip_gives_the_events_back(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    events = one_step()
    write_trace(path, events, ORIGIN, {"block_bytes": MiB, "links": {"nvme->gpu": 6.5}})
    trace = read_trace(path)
    assert trace.meta == {"block_bytes": MiB, "links": {"nvme->gpu": 6.5}, "version": VERSION}
    back = sorted(trace.events, key=lambda e: (e.start, e.kind))
    want = sorted(events, key=lambda e: (e.start, e.kind))
    assert [(e.kind, e.src, e.dst, e.layer, e.nbytes, e.blocks, e.error) for e in back] == \
           [(e.kind, e.src, e.dst, e.layer, e.nbytes, e.blocks, e.error) for e in want]
    for b, w in zip(back, want):
        assert b.start == pytest.approx(w.start - ORIGIN, abs=1e-8)
        assert b.done == pytest.approx(w.done - ORIGIN, abs=1e-8)
        assert b.submit == pytest.approx(w.submit - ORIGIN, abs=1e-8)


def test_tracks_steps_stall_and_one_lane_per_overlap() -> None:
    trace = chrome_trace(one_step(), ORIGIN)
    names = track_names(trace)
    by_track = defaultdict(list)
    for s in slices(trace):
        by_track[names[s["tid"]]].append(s)
    assert sorted(by_track) == ["cpu->nvme", "hits", "nvme->gpu", "nvme->gpu #2", "stall", "steps"]
    assert {s["name"] for s in by_track["steps"]} == {"step", "layer 0", "layer 1"}
    (stall,) = by_track["stall"]
    assert stall["cat"] == "stall" and stall["name"] == "stall L1" and stall["args"]["layer"] == 1
    assert stall["args"]["stall"] is True
    assert stall["args"]["waited_for"] == "nvme->gpu load 60 %, nvme->gpu prefetch 40 %"
    order = sorted((r["args"]["sort_index"], names[r["tid"]]) for r in trace["traceEvents"]
                   if r["name"] == "thread_sort_index")
    assert [n for _, n in order][:2] == ["steps", "stall"] and order[-1][1] == "hits"


def test_slices_carry_bytes_rate_and_error() -> None:
    by_kind = {s["args"]["kind"]: s for s in slices(chrome_trace(one_step(), ORIGIN))}
    prefetch = by_kind["prefetch"]
    assert prefetch["ts"] == pytest.approx(1000.0) and prefetch["dur"] == pytest.approx(5000.0)
    assert prefetch["args"]["bytes"] == 2 * MiB and prefetch["args"]["blocks"] == 2
    assert prefetch["args"]["GB/s"] == pytest.approx(2 * MiB / 0.005 / 1e9, rel=1e-3)
    assert prefetch["args"]["queued_us"] == pytest.approx(500.0)
    assert by_kind["writeback"]["args"]["error"] == "DiskFullError"
    assert "GB/s" not in by_kind["step"]["args"]


def test_slices_on_a_track_nest_or_follow_never_overlap_partly() -> None:
    events = one_step() + [ev("load", 0.0015 + i * 0.0001, 0.008, "nvme", "gpu", 1, MiB) for i in range(5)]
    trace = chrome_trace(events, ORIGIN)
    by_tid = defaultdict(list)
    for s in slices(trace):
        by_tid[s["tid"]].append((s["ts"], s["ts"] + s["dur"]))
    for spans in by_tid.values():
        open_ends: list[float] = []
        for begin, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= begin:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], "a slice ends outside the slice it starts in"
            open_ends.append(end)
    assert len([n for n in track_names(trace).values() if n.startswith("nvme->gpu")]) == 7


BAD_FILES = {
    "missing": (None, "no such trace file"),
    "empty": ("", "empty"),
    "not json": ("hello", "not valid JSON"),
    "truncated": (None, "truncated"),
    "no traceEvents": ('{"events": []}', 'no "traceEvents"'),
    "a list": ("[1, 2]", 'no "traceEvents"'),
    "foreign trace": ('{"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": 1, "args": {}}]}',
                      "no tierkv events"),
    "bad event": ('{"traceEvents": [{"name": "load", "ph": "X", "ts": "soon", "dur": 1, '
                  '"args": {"kind": "load"}}]}', "traceEvents[0]"),
    "negative dur": ('{"traceEvents": [{"name": "load", "ph": "X", "ts": 0, "dur": -5, '
                     '"args": {"kind": "load"}}]}', "traceEvents[0]"),
    "newer version": ('{"traceEvents": [], "tierkv": {"version": 99}}', "version 99"),
    "bad meta": ('{"traceEvents": [], "tierkv": [1]}', '"tierkv" must be an object'),
    "version true": ('{"traceEvents": [], "tierkv": {"version": true}}', "version True"),
    "huge bytes": ('{"traceEvents": [{"name": "load", "ph": "X", "ts": 0, "dur": 1, '
                   '"args": {"kind": "load", "bytes": 1e999}}]}', "cannot convert float infinity"),
    "negative blocks": ('{"traceEvents": [{"name": "hit", "ph": "X", "ts": 0, "dur": 1, '
                        '"args": {"kind": "hit", "blocks": -1000}}]}', "blocks=-1000"),
    "nested deep": ('{"traceEvents": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested deeper"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_trace_files_give_one_line_naming_file_and_problem(tmp_path: Path, case: str) -> None:
    text, problem = BAD_FILES[case]
    path = tmp_path / "trace.json"
    if case == "truncated":
        write_trace(path, one_step(), ORIGIN)
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        read_trace(path)
    message = str(raised.value)
    assert str(path) in message and problem in message and "\n" not in message


def test_a_device_of_endless_bytes_is_refused_at_its_first_ones() -> None:
    with pytest.raises(ConfigError, match="/dev/zero: not a JSON trace \\(it does not start with '\\{'\\)"):
        read_trace(Path("/dev/zero"))


def test_binary_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ConfigError, match="binary"):
        read_trace(path)


def test_meta_values_that_json_cannot_hold_are_written_as_text(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    write_trace(path, one_step(), ORIGIN, {"nvme_dir": tmp_path})
    assert json.loads(path.read_text())["tierkv"]["nvme_dir"] == str(tmp_path)


def test_profiler_range_is_a_shared_no_op_without_a_profiler() -> None:
    if torch.cuda.is_available():
        pytest.skip("with CUDA the range is an NVTX range")
    assert profiler_range("a") is profiler_range("b")
    with profiler_range("layer 3"):
        pass


def test_profiler_range_shows_in_a_torch_profiler_trace() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiler_range("tierkv step 7"):
            torch.ones(4).sum()
    assert "tierkv step 7" in {e.key for e in prof.key_averages()}
