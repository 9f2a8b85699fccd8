"""Access traces: what the recorder sees, the file format, and clear errors for bad files."""
from __future__ import annotations

import json
import math
import os
import struct

import xxhash

import numpy as np
import pytest
import torch

from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.manager.manager import TierManager
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_file import COLUMNS
from tierkv.profile.access_trace import ARRIVING, NOWHERE, AccessTrace, OpKind, TierSpec, TraceMeta
from tierkv.profile.link_stats import device_stats, link_stats
from tierkv.events import Event
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import MemoryTier

BLOCK = 4096
META = TraceMeta(BLOCK, (TierSpec("gpu", "gpu", 4), TierSpec("nvme", "nvme", 100)))


def key(i: int) -> BlockKey:
    return BlockKey.of("access", i)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def small_trace(layers: int = 0) -> AccessTrace:
    clock = Clock()
    rec = AccessRecorder(clock=clock)
    rec.begin_step("prefill", 512)
    for i in range(3):
        rec.on_put(key(i), 0)
        clock.t += 0.5
    rec.begin_step("decode", 1)
    rec.on_acquire([key(2), key(0)], 1)
    clock.t += 0.25
    rec.on_acquire([key(7)], None)
    meta = TraceMeta(BLOCK, META.tiers, layers=layers, info={"model": "test"})
    return rec.trace(meta=meta)


# -- what the recorder sees ------------------------------------------------------------
def test_blocks_get_dense_ids_in_first_seen_order_and_calls_keep_their_step_and_layer() -> None:
    trace = small_trace()
    assert trace.block.tolist() == [0, 1, 2, 2, 0, 3]
    assert trace.op_count.tolist() == [1, 1, 1, 2, 1]
    assert trace.op_kind.tolist() == [OpKind.PUT] * 3 + [OpKind.GET] * 2
    assert trace.op_step.tolist() == [0, 0, 0, 1, 1]
    assert trace.op_layer.tolist() == [0, 0, 0, 1, -1]
    assert trace.op_time.tolist() == [0.0, 0.5, 1.0, 1.5, 1.75]
    assert trace.step_kind.tolist() == [0, 1] and trace.step_tokens.tolist() == [512, 1]
    assert trace.n_blocks == 4 and trace.n_ops == 5
    assert [op.blocks.tolist() for op in trace.ops()] == [[0], [1], [2], [2, 0], [3]]


def test_calls_before_the_first_step_get_an_implicit_prefill_step() -> None:
    rec = AccessRecorder(clock=Clock())
    rec.on_put(key(0), None)
    trace = rec.trace(meta=META)
    assert trace.step_kind.tolist() == [0] and trace.op_step.tolist() == [0]


def test_an_unknown_step_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed: prefill, decode"):
        AccessRecorder().begin_step("train", 1)


def test_blocked_time_comes_from_the_wait_and_put_events_of_each_call() -> None:
    clock = Clock()
    rec = AccessRecorder(clock=clock)
    origin = rec.origin
    rec.on_put(key(0), 0)                        # t = 0: its put transfer is submitted at 0.1, done at 0.3
    clock.t = 1.0
    rec.on_acquire([key(0)], 0)                  # t = 1: found resident, no wait event
    clock.t = 2.0
    rec.on_acquire([key(1)], 0)                  # t = 2: waited from 2.01 to 2.5
    events = [Event("put", "", "gpu", 0, BLOCK, origin + 0.1, origin + 0.1, origin + 0.3),
              Event("wait", "", "gpu", 0, BLOCK, origin + 2.01, origin + 2.01, origin + 2.5),
              Event("load", "nvme", "gpu", 0, BLOCK, origin + 2.01, origin + 2.02, origin + 2.49)]
    trace = rec.trace(events=events, meta=META)
    assert trace.op_blocked.tolist() == pytest.approx([0.3, 0.0, 0.5])
    assert trace.waited(OpKind.GET) == pytest.approx(0.5)
    assert trace.waited(OpKind.PUT) == pytest.approx(0.3)


def guessed_trace() -> AccessTrace:
    """A decode step as the sparse engine records it: layer 0 reads, guesses layer 1, layer 1 reads."""
    clock = Clock()
    rec = AccessRecorder(clock=clock)
    rec.begin_step("decode", 1)
    rec.on_acquire([key(0), key(1)], 0)
    clock.t = 0.5
    rec.on_guess([key(2), key(3)], 1, "speculative")
    rec.on_guess([key(4)], 1, "other")
    clock.t = 1.0
    rec.on_acquire([key(2), key(5)], 1)
    return rec.trace(meta=META)


def test_a_guess_is_an_op_of_its_own_kind_naming_its_source() -> None:
    trace = guessed_trace()
    assert trace.op_kind.tolist() == [OpKind.GET, OpKind.GUESS, OpKind.GUESS, OpKind.GET]
    assert trace.meta.sources == ("speculative", "other") and trace.op_source.tolist() == [0, 0, 1, 0]
    assert trace.meta.engine == "sparse" and META.engine == "dense"
    assert [(op.kind, op.layer, op.source, op.blocks.tolist()) for op in trace.ops()][1:3] == [
        (OpKind.GUESS, 1, "speculative", [2, 3]), (OpKind.GUESS, 1, "other", [4])]
    assert trace.guesses("speculative").tolist() == [1] and trace.guesses("nobody").tolist() == []
    assert trace.served() == {"gpu": 0, "nvme": 0, "arriving": 0, "nowhere": 4}   # guesses are no reads
    with pytest.raises(ValueError, match="name the prefetcher"):
        AccessRecorder().on_guess([key(0)], 1, "")


def test_guesses_survive_the_file(tmp_path) -> None:
    trace = guessed_trace()
    trace.write(tmp_path / "sparse.trace")
    back = AccessTrace.read(tmp_path / "sparse.trace")
    assert back == trace and back.meta.sources == ("speculative", "other")
    assert [op.source for op in back.ops()] == ["", "speculative", "other", ""]


def test_a_wait_after_a_guess_belongs_to_the_get_before_it() -> None:
    clock = Clock()
    rec = AccessRecorder(clock=clock)
    origin = rec.origin
    rec.on_acquire([key(0)], 0)                  # t = 0: its rest arrives while the layer guesses
    clock.t = 0.5
    rec.on_guess([key(1)], 1, "speculative")     # t = 0.5
    events = [Event("wait", "", "gpu", 0, BLOCK, origin + 0.6, origin + 0.6, origin + 0.8)]
    assert rec.trace(events=events, meta=META).op_blocked.tolist() == pytest.approx([0.8, 0.0])


async def test_the_recorder_on_a_manager_notes_the_tier_each_block_was_in() -> None:
    gpu = MemoryTier("gpu", Medium.GPU, torch.device("cpu"), BLOCK, 2 * BLOCK)
    cpu = MemoryTier("cpu", Medium.CPU, torch.device("cpu"), BLOCK, 8 * BLOCK)
    async with TierManager([gpu, cpu]) as manager:
        rec = AccessRecorder().attach(manager)
        assert manager.access is rec
        rec.begin_step("prefill", 3)
        for i in range(3):
            await manager.put(key(i), torch.full((BLOCK,), i, dtype=torch.uint8), layer=0)
        rec.begin_step("decode", 1)
        (await manager.acquire([key(0), key(2)], layer=0)).release()
        trace = rec.trace()
    assert [t.name for t in trace.meta.tiers] == ["gpu", "cpu"]
    assert trace.meta.tiers[0].slots == 2 and trace.meta.block_bytes == BLOCK
    assert trace.where.tolist() == [NOWHERE] * 3 + [0, 1]  # puts: new blocks; gets: in gpu, in cpu
    assert trace.served(("decode",)) == {"gpu": 1, "cpu": 1, "arriving": 0, "nowhere": 0}
    assert trace.hit_rates(("decode",)) == {"gpu": 0.5, "cpu": 1.0}
    assert trace.meta.timed and trace.meta.info["links"]["new->gpu"]["bytes"] == 2 * BLOCK


def test_link_stats_count_overlapping_transfers_once() -> None:
    events = [Event("load", "nvme", "gpu", 0, 100, 0.0, 0.0, 1.0, 2),
              Event("prefetch", "nvme", "gpu", 1, 300, 0.2, 0.5, 2.0, 3),
              Event("writeback", "gpu", "nvme", None, 50, 3.0, 3.0, 3.5),
              Event("wait", "", "gpu", 0, 100, 0.0, 0.0, 1.0)]
    stats = link_stats(events)
    assert stats["nvme->gpu"] == {"transfers": 2, "blocks": 5, "bytes": 400, "busy_s": 2.5, "union_s": 2.0,
                                  "queued_s": pytest.approx(0.15)}
    assert set(stats) == {"nvme->gpu", "gpu->nvme"}                  # waits are not transfers
    device = device_stats(events, ["nvme"])["nvme"]                  # reads and writes, one device
    assert (device["bytes"], device["union_s"]) == (450, pytest.approx(2.5))


# -- the file ------------------------------------------------------------------------
def test_a_trace_written_and_read_back_is_identical(tmp_path) -> None:
    trace = small_trace(layers=2)
    object.__setattr__(trace, "layer_start", np.array([0.0, 0.25, math.nan, 1.5]))  # NaN: unknown
    path = tmp_path / "run.trace"
    trace.write(path)
    back = AccessTrace.read(path)
    assert back == trace
    assert back.meta.info == {"model": "test"} and back.meta.tiers == META.tiers
    for name in ("block", "op_time", "layer_start", "where"):
        assert getattr(back, name).dtype == getattr(trace, name).dtype
    assert path.read_bytes()[:8] == b"TKVTRACE"


def test_the_file_is_the_documented_layout(tmp_path) -> None:
    path = tmp_path / "run.trace"
    small_trace().write(path)
    raw = path.read_bytes()
    magic, version, header_len = struct.unpack_from("<8sII", raw)
    header = json.loads(raw[16:16 + header_len])
    assert (magic, version, header_len % 8) == (b"TKVTRACE", 2, 0)
    assert header["format"] == "tierkv-access"
    columns = {c["name"]: c for c in header["columns"]}
    offset = 16 + header_len + sum(-(-c["count"] * np.dtype(c["dtype"]).itemsize // 8) * 8
                                   for c in header["columns"][:header["columns"].index(columns["block"])])
    assert np.frombuffer(raw, "<u4", columns["block"]["count"], offset).tolist() == [0, 1, 2, 2, 0, 3]
    assert columns["op_source"] == {"name": "op_source", "dtype": "<u1", "count": 5}


def version_1_file(path, trace: AccessTrace) -> None:
    """``trace`` as version 1 laid it out: no op_source column, no meta.sources."""
    names = ["step_kind", "step_tokens", "step_time", "op_kind", "op_step", "op_layer", "op_count", "op_time",
             "op_blocked", "block", "where", "layer_start"]
    chunks = [getattr(trace, n).tobytes() for n in names]
    chunks = [c + b"\0" * (-len(c) % 8) for c in chunks]
    meta = trace.meta.as_dict()
    del meta["sources"]
    header = {"format": "tierkv-access", "meta": meta, "checksum": xxhash.xxh3_64(b"".join(chunks)).hexdigest(),
              "columns": [{"name": n, "dtype": COLUMNS[n], "count": len(getattr(trace, n))} for n in names]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<8sII", b"TKVTRACE", 1, len(text)) + text + b"".join(chunks))


def test_a_version_1_file_still_reads(tmp_path) -> None:
    trace = small_trace(layers=2)
    version_1_file(tmp_path / "old.trace", trace)
    back = AccessTrace.read(tmp_path / "old.trace")
    assert back == trace and back.op_source.tolist() == [0] * 5 and back.meta.sources == ()


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "run.trace"
    small_trace(layers=2).write(path)
    return path


@pytest.mark.parametrize("keep", [0, 10, 17, 40, -30, -1])
def test_a_truncated_file_is_a_clear_error(trace_file, keep) -> None:
    raw = trace_file.read_bytes()
    trace_file.write_bytes(raw[:keep] if keep >= 0 else raw[:len(raw) + keep])
    with pytest.raises(ConfigError, match=r"run\.trace: not a valid tierkv access trace: truncated"):
        AccessTrace.read(trace_file)


@pytest.mark.parametrize("cut", [None, -1, "extra"])
def test_a_trace_read_from_a_pipe_is_read_whole_or_named_truncated(trace_file, tmp_path, cut) -> None:
    """A pipe (``tierkv tune <(cat run.tkv)``) has no size: it was "truncated: the file has 0" bytes."""
    import threading
    raw = trace_file.read_bytes()
    sent = raw if cut is None else raw[:cut] if cut == -1 else raw + b"\0" * 8
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_bytes, args=(sent,))
    writer.start()
    try:
        if cut is None:
            assert AccessTrace.read(pipe) == AccessTrace.read(trace_file)
        else:
            with pytest.raises(ConfigError, match="truncated" if cut == -1 else "trailing bytes"):
                AccessTrace.read(pipe)
    finally:
        writer.join()


@pytest.mark.parametrize("edit, message", [
    (lambda raw: b"NOTATRACE" + raw[9:], "magic"),
    (lambda raw: raw[:8] + struct.pack("<I", 3) + raw[12:], "format version 3; this tierkv reads versions 1, 2"),
    (lambda raw: raw[:8] + struct.pack("<I", 1) + raw[12:], "lists columns .* expected"),
    (lambda raw: raw + b"\0" * 8, "trailing bytes"),
    (lambda raw: raw[:-8] + bytes([raw[-8] ^ 0xFF]) + raw[-7:], "checksum"),
    (lambda raw: raw[:16] + b"\xff" + raw[17:], "not UTF-8 JSON"),
    (lambda raw: raw[:16] + b"[" + raw[17:], "not UTF-8 JSON"),
])
def test_a_malformed_file_is_a_clear_error(trace_file, edit, message) -> None:
    trace_file.write_bytes(edit(trace_file.read_bytes()))
    with pytest.raises(ConfigError, match=rf"run\.trace: not a valid tierkv access trace: .*{message}"):
        AccessTrace.read(trace_file)


def rewrite_header(path, change) -> None:
    """Edit the JSON header (keeping the checksum valid: the columns are untouched)."""
    raw = path.read_bytes()
    header_len = struct.unpack_from("<I", raw, 12)[0]
    header = json.loads(raw[16:16 + header_len])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(raw[:12] + struct.pack("<I", len(text)) + text + raw[16 + header_len:])


@pytest.mark.parametrize("change, message", [
    (lambda h: h["columns"][0].update(dtype="<f8"), "column 'step_kind': dtype '<f8'"),
    (lambda h: h["columns"].pop(), "lists columns"),
    (lambda h: h["meta"].pop("block_bytes"), "meta is incomplete"),
    (lambda h: h["meta"].update(read_tier="ssd"), "read_tier='ssd'"),
    (lambda h: h.update(format="other"), "format is not 'tierkv-access'"),
])
def test_a_header_that_does_not_describe_a_trace_is_a_clear_error(trace_file, change, message) -> None:
    rewrite_header(trace_file, change)
    with pytest.raises(ConfigError, match=rf"run\.trace: .*{message}"):
        AccessTrace.read(trace_file)


def test_columns_that_contradict_each_other_are_a_clear_error(tmp_path) -> None:
    trace = small_trace()
    broken = {name: getattr(trace, name) for name in ("step_kind", "step_tokens", "step_time", "op_kind", "op_step",
                                                       "op_layer", "op_count", "op_time", "op_blocked", "block",
                                                       "where", "layer_start")}
    broken["op_count"] = np.array([1, 1, 1, 2, 2])
    with pytest.raises(ConfigError, match="op_count does not add up to the blocks"):
        AccessTrace(trace.meta, **broken)
    broken["op_count"], broken["where"] = trace.op_count, np.array([0, 1, 2, 3, 4, 5])
    with pytest.raises(ConfigError, match="where names no tier"):
        AccessTrace(trace.meta, **broken)
    broken["where"] = np.array([ARRIVING, NOWHERE, 0, 1, 0, 1])
    assert AccessTrace(trace.meta, **broken).where.tolist()[:2] == [ARRIVING, NOWHERE]
    broken["op_kind"] = np.array([0, 0, 0, 2, 1])
    with pytest.raises(ConfigError, match="op_source names no source"):
        AccessTrace(trace.meta, **broken)       # a guess, and the meta names no prefetcher


def test_a_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="nothing.trace: cannot read the access trace"):
        AccessTrace.read(tmp_path / "nothing.trace")


def test_each_kind_of_trace_given_to_the_other_command_says_which_reads_it(trace_file, tmp_path) -> None:
    from tierkv.profile.trace import read_trace
    with pytest.raises(ConfigError, match="an access trace of tierkv run --record-access: tierkv tune reads those"):
        read_trace(trace_file)
    (tmp_path / "run.json").write_text('{"traceEvents": []}')
    with pytest.raises(ConfigError, match="a JSON trace of tierkv run --trace\\? tierkv profile reads those"):
        AccessTrace.read(tmp_path / "run.json")
