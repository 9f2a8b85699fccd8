"""Chrome / Perfetto trace export of recorded events (open in ui.perfetto.dev).

One track (thread id) per tier link, one for waits ("stall"), one for the
steps a caller marks; every slice carries its bytes and achieved GB/s.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tierkv.profile.events import Event

PID = 1


def chrome_trace(events: Iterable[Event], origin: float) -> dict[str, object]:
    tracks: dict[str, int] = {}
    out: list[dict[str, object]] = []
    for e in events:
        track = "stall" if e.kind == "wait" else ("steps" if e.kind in ("step", "prefill") else f"{e.src or 'new'}->{e.dst}")
        tid = tracks.setdefault(track, len(tracks) + 1)
        seconds = max(e.done - e.start, 1e-9)
        args: dict[str, object] = {"bytes": e.nbytes, "blocks": e.blocks, "layer": e.layer,
                                   "queued_us": round((e.start - e.submit) * 1e6, 1)}
        if e.nbytes and e.kind not in ("step", "prefill"):
            args["GB/s"] = round(e.nbytes / seconds / 1e9, 3)
        if e.error:
            args["error"] = e.error
        out.append({"name": e.kind, "ph": "X", "pid": PID, "tid": tid, "ts": (e.start - origin) * 1e6,
                    "dur": seconds * 1e6, "args": args})
    for track, tid in tracks.items():
        out.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": track}})
    out.append({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "tierkv"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(path: Path, events: Iterable[Event], origin: float) -> None:
    Path(path).write_text(json.dumps(chrome_trace(events, origin)))
