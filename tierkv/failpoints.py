"""Named points in the write paths where a crash test can have the process killed, for real.

A test process sets ``TIERKV_FAILPOINTS`` before tierkv starts; reaching an armed point the
given number of times sends the process SIGKILL there (no cleanup, no flush: a power cut of
the process, not an exception a ``with`` would catch)::

    TIERKV_FAILPOINTS="journal.mid-record:3"            the third journal append dies half written
    TIERKV_FAILPOINTS="nvme.after-data:1,index.before-rename:2"
    TIERKV_FAILPOINTS="batch.worker-document@c.txt"     every visit with that key dies (a poison input)

    point                      where
    nvme.after-data            a block batch's bytes are in slots.dat, its journal record is not
    journal.mid-record         half of an append's records are written
    journal.after-record       the records are written, the process's own index not yet updated
    index.before-rename        a stored sparse index is written to its temporary name
    checkpoint.before-rename   a prefill checkpoint likewise
    restore.before-rename      a prefill's restore point likewise
    batch.worker-call          a Ray batch worker takes a batch of documents (the worker dies)
    batch.worker-document      a Ray batch worker starts on a document (key: its id)

Unarmed (the default) a point costs one truth test of an empty dict.
"""
from __future__ import annotations

import os
import signal

from tierkv.errors import ConfigError

POINTS = ("nvme.after-data", "journal.mid-record", "journal.after-record", "index.before-rename",
          "checkpoint.before-rename", "restore.before-rename", "batch.worker-call", "batch.worker-document")


def parse(text: str) -> dict[str, int]:
    """``"name:count,name,name@key"`` -> {name: count (1 when not given), "name@key": 1}."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "@" in item:
            name, _, key = item.partition("@")
            if name not in POINTS or not key:
                raise ConfigError(f"TIERKV_FAILPOINTS: {item!r}: give a known point and a key after '@'; "
                                  f"points: {', '.join(POINTS)}")
            armed[item] = 1
            continue
        name, _, count = item.partition(":")
        if name not in POINTS:
            raise ConfigError(f"TIERKV_FAILPOINTS: unknown point {name!r}; points: {', '.join(POINTS)}")
        if count and not (count.isdigit() and int(count) >= 1):
            raise ConfigError(f"TIERKV_FAILPOINTS: {item!r}: the count must be a whole number >= 1")
        armed[name] = int(count or 1)
    return armed


_ARMED = parse(os.environ.get("TIERKV_FAILPOINTS", ""))


def arm(text: str) -> None:
    """Arm points as ``TIERKV_FAILPOINTS`` would, in a process already running (a forked crash test)."""
    armed = parse(text)
    _ARMED.clear()
    _ARMED.update(armed)


def failpoint(name: str, key: str | None = None) -> None:
    """Die here (SIGKILL) if ``name`` is armed and this is its count-th visit, or if it is armed for ``key``
    (then at every visit with it)."""
    if _ARMED and (due(name) or (key is not None and f"{name}@{key}" in _ARMED)):
        kill()


def due(name: str) -> bool:
    """A visit to ``name``: True when it is the one to die at (the caller does half its work first)."""
    if not _ARMED or name not in _ARMED:
        return False
    _ARMED[name] -= 1
    return _ARMED[name] == 0


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
