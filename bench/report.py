"""What every benchmark hands back: machine facts, rows, ratios and bounds.

The JSON format, the same for every benchmark::

    {"bench": ..., "quick": ..., "machine": machine(),
     "rows":   [{"config", "metric", "value", "unit", **extra}],
     "ratios": [{"name", "value", "target", "meaning"}],
     "bounds": ["what limits each row ..."]}

A benchmark measures into a `Report` (data), then prints it and writes it;
nothing here measures or decides. Scripts in ``bench/`` import it as
``from report import Report`` (their own directory is on ``sys.path``).

Run as a command, it prints reports written with ``--out`` again; given
several, it puts their ratios side by side (runs to compare)::

    python bench/report.py bench/out/tiers-1.json bench/out/tiers-2.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

Format = Callable[[Any], str]


# -- machine facts ----------------------------------------------------------
def whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (a count of steps, rounds, threads, tries)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {minimum}")
        return value
    return parse


class Help(argparse.RawDescriptionHelpFormatter):
    """A bench script's help: its description as written, and each option's default where its text
    does not speak of it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        empty = default is None or isinstance(default, bool) or default in ("", [], ()) or default is argparse.SUPPRESS
        if empty or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def out_file(text: str) -> Path:
    """An argparse type: a JSON file the run can write when it ends (checked before it starts, not after)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: a directory; give a file's name")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot be written there ({parent} is not a writable directory)")
    return path


def stop_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill``) ends the run as Ctrl-C does: its ``finally`` blocks remove the scratch."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def machine(disk_path: str | Path = ".") -> dict[str, Any]:
    """CPU model, usable threads, CUDA device, RAM, and the file system under ``disk_path``."""
    fstype, device, mount = filesystem(disk_path)
    return {
        "cpu": _cpu_model(),
        "threads": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cuda": _cuda_name(),
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "disk": f"{fstype} on {device} (mounted at {mount})",
        "load_avg_1m": round(os.getloadavg()[0], 2),  # others' work on a shared machine skews every row
        "python": platform.python_version(),
        "torch": _torch_version(),
    }


def available_ram() -> int:
    """Bytes of host memory free now."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def filesystem(path: str | Path) -> tuple[str, str, str]:
    """``(fstype, device, mountpoint)`` of the mount holding ``path`` (the longest matching mount)."""
    target = os.path.realpath(path)
    best = ("unknown", "unknown", "/")
    best_len = -1
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        device, mount, fstype, *_ = line.split()
        mount = mount.replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best_len:
            best, best_len = (fstype, device, mount), len(mount)
    return best


class DirectPages:
    """Random page reads at the device's limit: one O_DIRECT ``pread`` of ``page_bytes`` at each of
    ``offsets`` in ``path``, dealt round-robin to ``threads`` threads. Opening raises OSError where
    O_DIRECT is refused."""

    def __init__(self, path: Path, page_bytes: int, offsets: Sequence[int], threads: int) -> None:
        self.path, self.page_bytes, self.offsets, self.threads = path, page_bytes, list(offsets), threads
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        self.bufs = [memoryview(mmap.mmap(-1, page_bytes)) for _ in range(threads)]   # page-aligned
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-pages")

    def read(self) -> None:
        def worker(t: int) -> None:
            for offset in self.offsets[t::self.threads]:
                if os.preadv(self.fd, [self.bufs[t]], offset) != self.page_bytes:
                    raise OSError(f"{self.path}: short O_DIRECT read at {offset}")
        for done in [self.pool.submit(worker, t) for t in range(self.threads)]:
            done.result()

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def random_read_rate(path: Path, page_bytes: int, offsets: Sequence[int], threads: int) -> float | None:
    """``DirectPages`` over ``offsets`` once: reads per second (a device's limit for random page loads;
    sequential GB/s says little about it). None where O_DIRECT is refused."""
    try:
        pages = DirectPages(path, page_bytes, offsets, threads)
    except OSError:
        return None
    try:
        start = time.perf_counter()
        pages.read()
        return len(offsets) / (time.perf_counter() - start)
    finally:
        pages.close()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cuda_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


# -- the report -------------------------------------------------------------
@dataclass(slots=True)
class Ratio:
    name: str
    value: float
    target: float | None
    meaning: str
    ceiling: bool = False     # the target is a most (an error, an overhead, a share of time waited)

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        if self.ceiling:
            return "ok" if self.value <= self.target else "ABOVE"
        return "ok" if self.value >= self.target else "BELOW"


@dataclass(slots=True)
class Report:
    bench: str
    quick: bool
    machine: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    bounds: list[str] = field(default_factory=list)
    seconds: float | None = None  # wall time of the whole run

    def add_row(self, config: str, metric: str, value: float, unit: str, **extra: Any) -> dict[str, Any]:
        row = {"config": config, "metric": metric, "value": value, "unit": unit, **extra}
        self.rows.append(row)
        return row

    def add_ratio(self, name: str, value: float, target: float | None, meaning: str, *,
                  ceiling: bool = False) -> Ratio:
        ratio = Ratio(name, value, target, meaning, ceiling)
        self.ratios.append(ratio)
        return ratio

    def add_bound(self, text: str) -> None:
        self.bounds.append(text)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Report:
        return cls(doc["bench"], bool(doc.get("quick")), doc.get("machine") or {}, list(doc.get("rows") or []),
                   [Ratio(**r) for r in doc.get("ratios") or []], list(doc.get("bounds") or []), doc.get("seconds"))

    def to_dict(self) -> dict[str, Any]:
        return {"bench": self.bench, "quick": self.quick, "machine": self.machine, "seconds": self.seconds,
                "rows": self.rows, "ratios": [asdict(r) for r in self.ratios], "bounds": self.bounds}

    def write_json(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def finish(self, start: float, out: str | Path | None) -> Report:
        """Close a run begun at ``start`` (perf_counter): the machine's load at its end, its wall time;
        then print the tables and write ``out`` (when given)."""
        self.add_bound(f"load: 1-min load average {os.getloadavg()[0]:.2f} at the end on {os.cpu_count()} CPUs")
        self.seconds = round(time.perf_counter() - start, 1)
        self.print_table()
        if out:
            self.write_json(out)
        return self

    # -- printing -------------------------------------------------------------
    def print_table(self, columns: Sequence[str | tuple[str, str]] | None = None,
                    formats: dict[str, Format] | None = None, file: TextIO = sys.stdout) -> None:
        """Rows as an aligned table, then ratios against their targets, then bounds.

        ``columns``: row keys, or ``(key, header)`` pairs; default every key in first-seen order.
        """
        m = self.machine
        print(f"{self.bench}{' (quick)' if self.quick else ''}: {m.get('cpu')}, {m.get('threads')} threads, "
              f"cuda={m.get('cuda')}, disk {m.get('disk')}, load {m.get('load_avg_1m')}, "
              f"run {self.seconds} s", file=file)
        pairs = [(c, c) if isinstance(c, str) else c for c in (columns or _columns(self.rows))]
        cells = [[_cell(row.get(key), (formats or {}).get(key)) for key, _ in pairs] for row in self.rows]
        print_grid([header for _, header in pairs], cells, file)
        if self.ratios:
            print(file=file)
            grid = [[r.name, _cell(r.value), _cell(r.target), r.verdict, r.meaning] for r in self.ratios]
            print_grid(["ratio", "value", "target", "", "meaning"], grid, file)
        if self.bounds:
            print("\nbounds:", file=file)
            for text in self.bounds:
                print(f"- {text}", file=file)


def print_grid(header: Sequence[str], cells: Sequence[Sequence[str]], file: TextIO = sys.stdout) -> None:
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(header)]
    for line in (list(header), ["-" * w for w in widths], *cells):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip(), file=file)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


def _cell(value: Any, fmt: Format | None = None) -> str:
    if value is None:
        return "-"
    if fmt is not None:
        return fmt(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# -- the command ------------------------------------------------------------
def read_report(path: Path) -> Report:
    try:
        return Report.from_dict(json.loads(path.read_text()))
    except OSError as error:
        raise SystemExit(f"report.py: {path}: cannot read it ({error.strerror or error})") from None
    except (ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"report.py: {path}: not a report a bench script wrote with --out ({error!r:.120})") from None


def side_by_side(reports: Sequence[Report], names: Sequence[str], file: TextIO = sys.stdout) -> None:
    """Each ratio's value in every report (``-`` where one lacks it), with its target."""
    values = [{r.name: r for r in report.ratios} for report in reports]
    ratios = list(dict.fromkeys(name for found in values for name in found))
    target = {name: next(found[name].target for found in values if name in found) for name in ratios}
    cells = [[name, *(_cell(found[name].value) if name in found else "-" for found in values), _cell(target[name])]
             for name in ratios]
    print_grid(["ratio", *names, "target"], cells, file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, metavar="FILE", help="a report written with --out")
    args = parser.parse_args(argv)
    reports = [read_report(path) for path in args.reports]
    if len(reports) == 1:
        reports[0].print_table()
    else:
        names = [path.name for path in args.reports]
        side_by_side(reports, names if len(set(names)) == len(names) else [str(path) for path in args.reports])
    return 0


if __name__ == "__main__":
    sys.exit(main())
