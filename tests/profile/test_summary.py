"""The profile summary: planted stalls are found, charged to the right link and layer, and named."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tierkv import cli
from tierkv.errors import ConfigError
from tierkv.profile.command import add_profile
from tierkv.events import Event
from tierkv.profile.attribution import UNATTRIBUTED, TransferIndex, attribute
from tierkv.profile.summary import link_limit, summarize
from tierkv.profile.summary_text import format_summary
from tierkv.profile.trace import write_trace

MiB = 2**20
MS = 1e-3


def ev(kind: str, start: float, done: float, src: str = "", dst: str = "", layer: int | None = None,
       nbytes: int = 0, blocks: int = 1) -> Event:
    return Event(kind, src, dst, layer, nbytes, start, start, done, blocks)


def planted(steps: int = 4, layers: int = 4) -> list[Event]:
    """A prefill, then decode steps whose layer 2 waits 20 ms on nvme->gpu and layer 1 2 ms on cpu->gpu.

    Each layer finds 3 blocks in place in gpu; step ``s`` computes ``s`` ms longer, so latencies differ.
    The prefill holds a 100 ms nvme->gpu stall at layer 3 that the decode summary must not count.
    """
    events = [ev("prefill", 0.0, 0.5), ev("load", 0.1, 0.2, "nvme", "gpu", 3, 4 * MiB, 4),
              ev("wait", 0.1, 0.2, "", "gpu", 3, 4 * MiB, 4)]
    t = 1.0
    for s in range(steps):
        step_start = t
        for layer in range(layers):
            layer_start = t
            events.append(ev("hit", t, t, "gpu", "gpu", layer, 3 * MiB, 3))
            if layer == 2:
                events += [ev("load", t, t + 20 * MS, "nvme", "gpu", 2, 2 * MiB, 2),
                           ev("wait", t, t + 20 * MS, "", "gpu", 2, 2 * MiB, 2)]
                t += 20 * MS
            if layer == 1:
                events += [ev("load", t, t + 2 * MS, "cpu", "gpu", 1, MiB, 1),
                           ev("wait", t, t + 2 * MS, "", "gpu", 1, MiB, 1)]
                t += 2 * MS
            t += (5 + s) * MS
            events.append(ev("layer", layer_start, t, layer=layer))
        events.append(ev("step", step_start, t))
        t += 1 * MS
    return events


META = {"block_bytes": MiB, "links": {"nvme->gpu": 2.0}}


def test_planted_stall_is_the_top_cause() -> None:
    s = summarize(planted(), META)
    assert s.phase == "decode" and s.steps == 4 and s.waits == 8
    assert s.stall_s == pytest.approx(4 * 22 * MS)
    top = s.causes[0]
    assert (top.link, top.layer, top.waits) == ("nvme->gpu", 2, 4)
    assert top.of_stall == pytest.approx(20 / 22)
    assert top.describe() == "nvme->gpu loads at layer 2: 91 % of stall (4 waits, mean 20.0 ms)"
    assert (s.causes[1].link, s.causes[1].layer) == ("cpu->gpu", 1)


def test_stall_shares_per_link_and_layer() -> None:
    s = summarize(planted(), META)
    links = {r.key: r for r in s.by_link}
    assert set(links) == {"nvme->gpu", "cpu->gpu"}
    assert links["nvme->gpu"].of_stall == pytest.approx(20 / 22)
    assert links["nvme->gpu"].of_time == pytest.approx(80 * MS / s.phase_s)
    layers = {r.key: r for r in s.by_layer}
    assert set(layers) == {"1", "2"}       # the prefill's layer-3 stall is not decode time
    layer2_time = sum(20 + 5 + step for step in range(4)) * MS
    assert layers["2"].of_time == pytest.approx(80 * MS / layer2_time)


def test_step_latency_percentiles() -> None:
    s = summarize(planted(), META)
    lat = sorted(4 * 5 + 4 * step + 22 for step in range(4))   # ms per step
    assert s.step_ms["p50"] == pytest.approx((lat[1] + lat[2]) / 2)
    assert s.step_ms["max"] == pytest.approx(lat[-1])
    assert s.step_ms["p50"] <= s.step_ms["p90"] <= s.step_ms["p99"] <= s.step_ms["max"]


def test_prefill_phase_counts_only_the_prefill_stall() -> None:
    s = summarize(planted(), META, phase="prefill")
    assert s.stall_s == pytest.approx(0.1) and s.phase_s == pytest.approx(0.5)
    assert [(c.link, c.layer) for c in s.causes] == [("nvme->gpu", 3)]


def test_a_trace_without_steps_is_summarized_whole() -> None:
    events = [e for e in planted() if e.kind != "step"]
    s = summarize(events, META)
    assert s.phase == "all" and s.steps == 0 and s.step_ms == {}
    assert s.stall_s == pytest.approx(0.1 + 4 * 22 * MS)
    assert any("no decode steps" in n for n in s.notes)


def test_links_report_achieved_rate_over_busy_time_next_to_limit() -> None:
    s = summarize(planted(), META)
    nvme = next(r for r in s.links if r.link == "nvme->gpu")
    assert nvme.transfers == 4 and nvme.nbytes == 8 * MiB
    assert nvme.busy_s == pytest.approx(80 * MS)
    assert nvme.gbps == pytest.approx(8 * MiB / 0.080 / 1e9)
    assert nvme.limit_gbps == 2.0
    assert next(r for r in s.links if r.link == "cpu->gpu").limit_gbps is None


def test_link_limits_from_numbers_probe_records_or_two_hops_through_host_memory() -> None:
    probe = {"nvme->cpu": {"gbps": 3.0, "how": "O_DIRECT"}, "cpu->gpu": {"gbps": 12.0}, "gpu->cpu": 11.0}
    assert link_limit("cpu->gpu", probe) == 12.0
    assert link_limit("gpu->cpu", probe) == 11.0
    assert link_limit("nvme->gpu", probe) == 3.0          # the slower hop of nvme->cpu->gpu
    assert link_limit("gpu->nvme", probe) is None         # cpu->nvme was not measured
    assert link_limit("new->gpu", {}) is None


def test_links_without_a_limit_say_how_to_measure_them() -> None:
    notes = summarize(planted(), {}).notes
    assert any("no measured link limits" in n and "tierkv info --probe" in n for n in notes)
    notes = summarize(planted(), {"links": {"cpu->cpu": 9.0, "cpu->gpu": 12.0}}).notes   # memory links only
    assert "no measured limit for nvme->gpu (the disk's links: `tierkv info --probe --nvme-dir DIR` with the run's " \
           "--nvme-dir)" in notes
    assert not any("limit" in n for n in summarize(planted(), {"links": {"nvme->cpu": 2.0, "cpu->gpu": 12.0}}).notes)


def test_overlapping_transfers_count_once_toward_busy_time() -> None:
    events = [ev("step", 0, 1), ev("load", 0.0, 0.4, "nvme", "gpu", 0, MiB),
              ev("load", 0.2, 0.6, "nvme", "gpu", 0, MiB)]
    (link,) = summarize(events).links
    assert link.busy_s == pytest.approx(0.6)


def test_reads_hit_rates_and_reuse() -> None:
    s = summarize(planted(), META)
    reads = {r.source: r.share for r in s.reads}
    assert reads == pytest.approx({"in place in gpu": 12 / 15, "loaded from nvme": 2 / 15,
                                   "loaded from cpu": 1 / 15})
    assert s.reuse == pytest.approx(1 - 2 / 15)   # cpu->gpu moves a block already in memory


def test_missed_blocks_without_a_load_were_taken_from_a_prefetch_in_flight() -> None:
    events = [ev("step", 0, 1), ev("hit", 0.1, 0.1, "gpu", "gpu", 0, MiB, 1),
              ev("prefetch", 0.0, 0.3, "nvme", "gpu", 0, 3 * MiB, 3), ev("wait", 0.2, 0.3, "", "gpu", 0, 3 * MiB, 3)]
    s = summarize(events)
    assert {r.source: r.blocks for r in s.reads} == {"taken from a prefetch in flight": 3, "in place in gpu": 1}
    wasted = summarize([*events, ev("prefetch", 0.0, 0.3, "nvme", "gpu", 0, 5 * MiB, 5)])   # 8 in, 4 acquired
    assert wasted.reuse == 0.0 and "prefetches brought at least 4 blocks no step read" in " ".join(wasted.notes)
    assert s.causes[0].describe().startswith("nvme->gpu late prefetches at layer 0: 100 % of stall")


def test_without_hit_events_hit_rates_are_unknown_and_said_so() -> None:
    s = summarize([e for e in planted() if e.kind != "hit"], META)
    assert s.reads == [] and s.reuse is None
    assert any("`hit` events" in n for n in s.notes)


def test_a_wait_is_split_over_the_links_it_overlapped() -> None:
    events = [ev("load", 0.0, 0.5, "nvme", "gpu", 4, MiB), ev("demote", 0.5, 1.0, "gpu", "cpu", None, MiB),
              ev("prefetch", 0.0, 1.0, "nvme", "gpu", 5, MiB)]   # the next layer's: not waited for
    wait = ev("wait", 0.0, 1.0, "", "gpu", 4, MiB)
    assert attribute(wait, TransferIndex(events)) == pytest.approx({("nvme->gpu", "load"): 0.5,
                                                                 ("gpu->cpu", "demote"): 0.5})


def test_a_wait_that_names_its_source_is_charged_to_it_whole() -> None:
    wait = Event("wait", "cpu", "gpu", 0, MiB, 0.0, 0.0, 0.3)
    assert attribute(wait, TransferIndex([ev("load", 0.0, 0.3, "nvme", "gpu", 0, MiB)])) == \
        pytest.approx({("cpu->gpu", "load"): 0.3})


def test_a_wait_nothing_overlapped_is_unattributed_and_noted() -> None:
    events = [ev("step", 0, 1), ev("wait", 0.1, 0.4, "", "gpu", 0, MiB), ev("load", 0.5, 0.6, "nvme", "gpu", 0, MiB)]
    s = summarize(events)
    assert s.by_link[0].key == UNATTRIBUTED and s.by_link[0].of_stall == pytest.approx(1.0)
    assert any("overlapped no transfer" in n for n in s.notes)


def test_malformed_metadata_is_ignored_not_fatal() -> None:
    meta = {"links": {"nvme->gpu": "fast", "cpu->gpu": -1}, "tiers": {"gpu": "big", "cpu": {"budget_bytes": "x"}}}
    s = summarize(planted(), meta)
    assert all(r.limit_gbps is None for r in s.links)
    assert "tiers         gpu ?, cpu ?" in format_summary(s)
    assert summarize(planted(), {"links": [1], "tiers": 3}).tiers == {}


def test_bad_phase_and_empty_input_raise() -> None:
    with pytest.raises(ConfigError, match="phase='warmup'"):
        summarize(planted(), phase="warmup")
    with pytest.raises(ConfigError, match="no events"):
        summarize([])


def test_text_names_the_planted_stall() -> None:
    meta = META | {"tiers": {"gpu": {"budget_bytes": 4 * MiB, "peak_bytes": 3 * MiB}, "nvme": {}}}
    text = format_summary(summarize(planted(), meta), "t.json")
    assert "tiers         gpu 4.0 MiB (peak 3.0 MiB), nvme ?" in text
    assert "1. nvme->gpu loads at layer 2: 91 % of stall (4 waits, mean 20.0 ms)" in text
    assert "p50" in text and "p99" in text and "in place in gpu" in text
    assert "nvme->gpu" in text.split("link ")[-1]


# -- the command -------------------------------------------------------------
def run_profile(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tierkv")
    add_profile(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.json"
    write_trace(path, planted(), 0.0, META)
    return path


def test_profile_command_prints_the_cause(trace_file: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_profile(["profile", str(trace_file), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "1. nvme->gpu loads at layer 2: 91 % of stall" in out and "2. " not in out


def test_profile_command_json(trace_file: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_profile(["profile", str(trace_file), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == 4 and doc["top_causes"][0].startswith("nvme->gpu loads at layer 2")
    assert doc["stall_fraction"] == pytest.approx(doc["stall_s"] / doc["phase_s"])


@pytest.mark.parametrize("content", [None, "", '{"traceEvents": [', '{"traceEvents": [{"ph": "X", "name": "lo'])
def test_profile_command_reports_bad_files_in_one_line(tmp_path: Path, content: str | None,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    if add_profile not in cli.COMMANDS:
        monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, add_profile])
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tierkv: error: {path}: ") and "\n" not in err
