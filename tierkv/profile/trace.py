"""Chrome / Perfetto trace files of recorded events: write, read back, and profiler ranges.

Open a file in ui.perfetto.dev (or chrome://tracing). It is also the input of
``tierkv profile``, so it carries everything the summary needs::

    {"traceEvents": [...complete ("X") slices and track names ("M")...],
     "displayTimeUnit": "ms",
     "tierkv": {"version": 1,
                "block_bytes": 393216,                      # optional, like everything below
                "tiers": {"gpu": {"budget_bytes": ...}, ...},  # fastest first (the run's tier report)
                "links": {"nvme->gpu": 6.8, ...}}}           # measured limit of each link, GB/s

Tracks (threads of process "tierkv"), top to bottom::

    steps          prefill / decode-step slices; "layer N" slices nest inside them by time
    stall          one slice per wait (cat "stall"): a reader blocked on a transfer
    nvme->gpu      one track per tier link ("new->gpu" for puts); transfers that overlap
    nvme->gpu #2   on a link spill into numbered lanes, so slices on one track never overlap
    link cxl->gpu  a simulated CXL pool's own slices (cat "cxl"): bytes on its link, requests
    queue cxl->gpu queued for a channel, and "compute cxl", its near-memory processor (with
    compute cxl    "queue cxl" for commands waiting for it); they sit inside the transfer above
    hits           zero-length marks: blocks a reader found in place (``hit`` events)

Every slice's args carry its event's fields (kind, src, dst, layer, bytes,
blocks, queued_us, error) plus GB/s, so ``read_trace`` gives the events back,
with times in seconds from the run's origin. A stall slice also says what it
waited for ("waited_for": "nvme->gpu load 70 %, ..."), as ``tierkv profile`` charges it.
"""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierkv.device import has_cuda
from tierkv.errors import ConfigError
from tierkv.events import COMPUTE_KINDS, MODELLED_KINDS, Event, EventKind
from tierkv.profile.attribution import TransferIndex, attribute

VERSION = 1
PID = 1


# -- writing ---------------------------------------------------------------
def chrome_trace(events: Iterable[Event], origin: float, meta: dict | None = None) -> dict[str, object]:
    """The trace as a JSON-ready dict; ``meta`` goes under "tierkv" (see the module doc)."""
    events = sorted(events, key=lambda e: (e.start, -e.done))  # parents before the slices they hold
    lanes, blockers = _Lanes(), TransferIndex(events)
    out = [_slice(e, origin, lanes.tid(e, origin), blockers) for e in events]
    for sort_index, (name, tid) in enumerate(lanes.names()):
        out.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                    "args": {"sort_index": sort_index}})
    out.append({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "tierkv"}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "tierkv": {**(meta or {}), "version": VERSION}}


def write_trace(path: Path, events: Iterable[Event], origin: float, meta: dict | None = None) -> None:
    Path(path).write_text(json.dumps(chrome_trace(events, origin, meta), default=str))


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _slice(e: Event, origin: float, tid: int, blockers: TransferIndex) -> dict[str, object]:
    begin, end = _ns(e.start - origin), _ns(e.done - origin)
    args: dict[str, object] = {"kind": e.kind, "src": e.src, "dst": e.dst, "layer": e.layer,
                               "bytes": e.nbytes, "blocks": e.blocks,
                               "queued_us": round((e.start - e.submit) * 1e6, 3)}
    if e.nbytes and e.kind not in (*COMPUTE_KINDS, EventKind.QUEUE) and end > begin:
        args["GB/s"] = float(f"{e.nbytes / (end - begin):.4g}")   # bytes per ns = GB/s
    if e.error:
        args["error"] = e.error
    if e.kind == EventKind.WAIT:
        args["stall"] = True
        args["waited_for"] = _waited_for(e, blockers)
    return {"name": _label(e), "cat": _category(e), "ph": "X", "pid": PID, "tid": tid,
            "ts": begin / 1e3, "dur": max(end - begin, 0) / 1e3, "args": args}


def _waited_for(wait: Event, blockers: TransferIndex) -> str:
    """``nvme->gpu load 70 %, nvme->gpu prefetch 30 %``: how tierkv profile charges this wait."""
    parts = attribute(wait, blockers)
    total = sum(parts.values()) or 1.0
    return ", ".join(f"{link} {kind} {100 * s / total:.0f} %".replace("  ", " ")
                     for (link, kind), s in sorted(parts.items(), key=lambda kv: -kv[1]))


def _label(e: Event) -> str:
    if e.kind == EventKind.LAYER:
        return f"layer {e.layer}"
    if e.kind == EventKind.WAIT:
        return "stall" if e.layer is None else f"stall L{e.layer}"
    return e.kind


def _category(e: Event) -> str:
    if e.kind == EventKind.WAIT:
        return "stall"
    if e.kind in MODELLED_KINDS:
        return "cxl"
    return "compute" if e.kind in COMPUTE_KINDS else "transfer"


def _track(e: Event) -> str:
    if e.kind in COMPUTE_KINDS:
        return "steps"
    if e.kind in (EventKind.WAIT, EventKind.HIT):
        return "stall" if e.kind == EventKind.WAIT else "hits"
    if e.kind in MODELLED_KINDS:
        return f"{e.kind} {e.src}" if e.src == e.dst else f"{e.kind} {e.src or 'new'}->{e.dst}"
    return f"{e.src or 'new'}->{e.dst}"


@dataclass(slots=True)
class _Lanes:
    """Thread ids per track; a slice that overlaps every lane of its track opens a new lane."""

    ends: dict[str, list[int]] = field(default_factory=dict)     # track -> end (ns) of each lane
    tids: dict[tuple[str, int], int] = field(default_factory=dict)

    def tid(self, e: Event, origin: float) -> int:
        track, lane = _track(e), 0
        if track != "steps":   # the caller's one thread: its slices nest, never overlap partly
            ends = self.ends.setdefault(track, [])
            begin, end = _ns(e.start - origin), _ns(e.done - origin)
            lane = next((i for i, last in enumerate(ends) if last <= begin), len(ends))
            ends[lane:lane + 1] = [end]
        return self.tids.setdefault((track, lane), len(self.tids) + 1)

    def names(self) -> list[tuple[str, int]]:
        order = sorted(self.tids, key=lambda tl: (_track_rank(tl[0]), tl[0], tl[1]))
        return [(track if lane == 0 else f"{track} #{lane + 1}", self.tids[(track, lane)])
                for track, lane in order]


def _track_rank(track: str) -> int:
    if track.split(" ")[0] in MODELLED_KINDS:
        return 3   # a pool's slices under the transfers they belong to
    return {"steps": 0, "stall": 1, "hits": 4}.get(track, 2)


# -- reading ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Trace:
    """Events read back from a trace file (times in seconds from the run's origin) and its metadata."""

    path: Path
    events: list[Event]
    meta: dict


MAX_TRACE_BYTES = 4 * 2**30      # a trace file read whole: past this it is no trace a run wrote here


def read_trace(path: Path) -> Trace:
    """Parse a file ``write_trace`` wrote; raises ConfigError naming the file and the problem."""
    path = Path(path)
    doc = _load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ConfigError(f"{path}: not a tierkv trace: no \"traceEvents\" list at the top level")
    meta = doc.get("tierkv", {})
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: malformed trace: \"tierkv\" must be an object, got {type(meta).__name__}")
    version = meta.get("version", VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise ConfigError(f"{path}: trace format version {version!r}: this tierkv reads versions "
                          f"up to {VERSION}")
    events = [_event(path, i, r) for i, r in enumerate(doc["traceEvents"]) if _is_tierkv_slice(r)]
    if not events:
        raise ConfigError(f"{path}: the trace holds no tierkv events (write one with `tierkv run --trace FILE`)")
    events.sort(key=lambda e: (e.start, -e.done))
    return Trace(path, events, meta)


def _load_json(path: Path) -> object:
    try:
        if path.is_file() and path.stat().st_size > MAX_TRACE_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size} bytes, past the {MAX_TRACE_BYTES // 2**30} GiB a "
                              "trace file is read to")
        with open(path, encoding="utf-8") as f:
            text = f.read(2**16)
            if not path.is_file() and text.lstrip()[:1] not in ("{", ""):   # (a device's endless bytes)
                raise ConfigError(f"{path}: not a JSON trace (it does not start with '{{')")
            text += f.read(MAX_TRACE_BYTES + 1 - len(text))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such trace file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        hint = " (an access trace of tierkv run --record-access: tierkv tune reads those)" if _access_trace(path) else ""
        raise ConfigError(f"{path}: not a JSON trace (binary data){hint}") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it ({error.strerror or error})") from None
    if len(text) > MAX_TRACE_BYTES:
        raise ConfigError(f"{path}: more than the {MAX_TRACE_BYTES // 2**30} GiB a trace file is read to")
    if not text.strip():
        raise ConfigError(f"{path}: the trace file is empty")
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: not a tierkv trace: JSON nested deeper than any trace is") from None
    except json.JSONDecodeError as error:
        if error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string"):
            raise ConfigError(f"{path}: truncated JSON: the file ends at byte {len(text)} inside "
                              "the trace (was the run interrupted while writing it?)") from None
        raise ConfigError(f"{path}: not valid JSON: {error.msg} (line {error.lineno}, "
                          f"column {error.colno})") from None


def _access_trace(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"TKVTRACE"


def _is_tierkv_slice(record: object) -> bool:
    return (isinstance(record, dict) and record.get("ph") == "X" and isinstance(record.get("args"), dict)
            and "kind" in record["args"])


def _event(path: Path, index: int, r: dict) -> Event:
    a = r["args"]
    try:
        start = float(r["ts"]) / 1e6
        done = start + float(r["dur"]) / 1e6
        layer = None if a.get("layer") is None else int(a["layer"])
        event = Event(EventKind(a["kind"]), str(a.get("src", "")), str(a.get("dst", "")), layer,
                      int(a.get("bytes", 0)), start - float(a.get("queued_us", 0.0)) / 1e6, start, done,
                      int(a.get("blocks", 1)), str(a.get("error", "")))
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise ConfigError(f"{path}: malformed trace: traceEvents[{index}] ({r.get('name')!r}): "
                          f"bad or missing field {error}") from None
    if not (math.isfinite(event.start) and math.isfinite(event.done)) or event.done < event.start:
        raise ConfigError(f"{path}: malformed trace: traceEvents[{index}] has ts={r['ts']}, dur={r['dur']}")
    if event.nbytes < 0 or event.blocks < 0 or (event.layer is not None and event.layer < 0) \
            or not math.isfinite(event.submit):
        raise ConfigError(f"{path}: malformed trace: traceEvents[{index}] has bytes={event.nbytes}, "
                          f"blocks={event.blocks}, layer={event.layer}, queued_us={a.get('queued_us')}: "
                          "no run records these")
    return event


# -- ranges in torch.profiler / Nsight traces --------------------------------
@contextlib.contextmanager
def _nvtx_range(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """Mark ``name`` in a running torch.profiler trace (record_function) or, on CUDA, as an NVTX
    range for Nsight; otherwise a shared no-op (one C call, ~0.1 µs). Use as ``with profiler_range(...):``.
    """
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    if has_cuda():
        return _nvtx_range(name)
    return _NULL


_NULL = contextlib.nullcontext()
