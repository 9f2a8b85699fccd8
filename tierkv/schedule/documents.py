"""Documents in, one JSON line per document out, resumable.

Inputs are a JSONL file (one object per line with ``text`` and optionally ``id``, a string or a
number; the id defaults to the line number, or ``lineN`` where another line's id is that number)
or a directory (every regular file under it, sorted, read as UTF-8;
the id is the path inside the directory). A line or file that cannot be read becomes a document
with an ``error`` instead of stopping the batch.

The output is append-only JSONL; each record is written with one ``write`` and flushed to disk::

    {"id": "a.txt", "summary": "...", "prompt_tokens": 812, "tokens": 64, "timings": {...}}
    {"id": "b.txt", "error": "empty document"}

Resuming reads the file first: every complete line names a finished document, which is skipped.
A last line cut short by a kill (no newline, or not JSON) is cut off before appending, so each
document appears exactly once however often the run is interrupted.

An error line is final, like a summary; ``--retry-failed`` takes out the lines of the documents that
failed while they ran (``"error": "failed: ..."``) and runs those again, the file rewritten whole.

Each record carries ``"job"``: a digest of the settings that shape a summary (the model, the
instruction, the token limits, the dtypes; see ``JobConfig.output_settings``), and ``"settings"``:
those settings themselves (a long text, the instruction, as its digest). A resume with other
settings is refused, naming those that differ, so one file never mixes summaries made two ways.
"""
from __future__ import annotations

import codecs
import errno
import hashlib
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError, DiskFullError


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    text: str | None
    error: str | None = None


def read_inputs(path: Path, *, out: Path | None = None) -> list[Document]:
    """The documents of ``--inputs``: a .jsonl file, or every file below a directory but hidden ones and
    the output file ``out`` (an output written into the inputs is not a document)."""
    path = Path(path)
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"--inputs {path}: cannot read the directory (permission denied)")
        skip = None if out is None else Path(out).resolve()
        files = sorted(p for p in path.rglob("*") if not p.is_dir() and p.resolve() != skip
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ConfigError(f"--inputs {path}: no documents in it (give a directory of text files, or a "
                              '.jsonl file of {"id": ..., "text": ...} lines)')
        return [_read_file(f, path) for f in files]
    if path.is_file():
        if out is not None and Path(out).resolve() == path.resolve():
            raise ConfigError(f"--out {out}: is the --inputs file; give another file for the summaries")
        docs = _read_jsonl(path)
        if not docs:
            raise ConfigError(f"--inputs {path}: no documents in it (a .jsonl file of "
                              '{"id": ..., "text": ...} lines)')
        return docs
    raise ConfigError(f"--inputs {path}: no such file or directory (give a .jsonl file or a directory of texts)")


def _read_file(file: Path, root: Path) -> Document:
    name = file.relative_to(root).as_posix()
    if not file.is_file():       # not read: a pipe would wait for a writer
        return Document(name, None, "unreadable: not a regular file (a pipe, a device, or a link to nothing)")
    try:
        text = file.read_bytes().decode("utf-8")
        return Document(name, text) if "\0" not in text else Document(name, None, "unreadable: binary (NUL bytes)")
    except UnicodeDecodeError:
        return Document(name, None, "unreadable: not UTF-8 text")
    except OSError as e:
        return Document(name, None, f"unreadable: {e.strerror or e}")


def _read_jsonl(path: Path) -> list[Document]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--inputs {path}: cannot read it ({e.strerror or e})") from None
    # Lines end at "\n" alone: JSON text may hold U+2028 and the like, which str.splitlines() would split at.
    lines = raw.removeprefix(codecs.BOM_UTF8).split(b"\n")
    parsed = [(number, _parse_line(line, number)) for number, line in enumerate(lines, start=1) if line.strip()]
    if parsed and not any(is_object for _, (_, _, is_object) in parsed):
        raise ConfigError(f"--inputs {path}: not a .jsonl file (no line of it is a JSON object); give a file of "
                          '{"id": ..., "text": ...} lines, or a directory of text files')
    given = {doc.id for _, (doc, named, _) in parsed if named}
    docs, seen = [], set()

    def made_up(stem: str) -> str:             # a made-up id never takes a line's own
        return next(name for n in itertools.count(1)
                    if (name := stem + (f"#{n}" if n > 1 else "")) not in given and name not in seen)

    for number, (doc, named, _) in parsed:
        if not named and doc.id in given:
            doc = Document(made_up(f"line{number}"), doc.text, doc.error)
        if doc.id in seen:
            doc = Document(made_up(f"{doc.id}#line{number}"), None, f"duplicate id {doc.id!r}")
        seen.add(doc.id)
        docs.append(doc)
    return docs


def _parse_line(raw: bytes, number: int) -> tuple[Document, bool, bool]:
    """The line's document, whether its id is its own (not made up from ``number``), and whether the line
    is a JSON object."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Document(str(number), None, f"unreadable: line {number} is not UTF-8 text"), False, False
    try:
        data = json.loads(line)
    except ValueError:
        return Document(str(number), None, f"unreadable: line {number} is not JSON"), False, False
    if not isinstance(data, dict):
        return Document(str(number), None, f"unreadable: line {number} is not a JSON object"), False, False
    if "id" not in data:
        doc_id, named = str(number), False
    elif isinstance(data["id"], (str, int, float)) and not isinstance(data["id"], bool):
        doc_id, named = str(data["id"]), True
    else:
        return Document(str(number), None, f"unreadable: line {number}'s \"id\" is "
                        f"{json.dumps(data['id'])}: give a string or a number"), False, True
    text = data.get("text")
    if not isinstance(text, str):
        return Document(doc_id, None, "unreadable: no \"text\" string"), named, True
    return Document(doc_id, text), named, True


FAILED = "failed: "     # an error line's prefix where the document failed while it ran (not one that cannot run)


def settings_digest(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(settings), sort_keys=True).encode()).hexdigest()[:16]


LONG_SETTING = 80       # characters past which a record keeps a setting's digest, not its text


def settings_shown(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as a record keeps them: a text longer than ``LONG_SETTING`` as ``sha256:<digest>``."""
    return {name: f"sha256:{hashlib.sha256(value.encode()).hexdigest()[:16]}"
            if isinstance(value, str) and len(value) > LONG_SETTING else value for name, value in settings.items()}


class OutputLog:
    """The output JSONL: which ids are done, and appending a record durably. ``settings``: what shapes
    a record (its digest goes into each one; records made under others are refused)."""

    def __init__(self, path: Path, settings: Mapping[str, Any] | None = None, *, retry_failed: bool = False) -> None:
        """``retry_failed``: the lines of documents that failed (``"error": "failed: ..."``: a worker that
        died, an exception) are taken out of the file, so those documents run again; the lines of those
        that cannot run (empty, unreadable, too long) stay."""
        self.path = Path(path)
        self.done: set[str] = set()
        self.retry_failed = retry_failed
        self.settings = dict(settings or {})
        self.job = settings_digest(self.settings) if settings is not None else None
        self.shown = settings_shown(self.settings)
        if self.path.is_dir():
            raise ConfigError(f"--out {self.path}: is a directory; give a .jsonl file")
        if not self.path.parent.is_dir():          # as every output flag: a mistyped folder is not made
            raise ConfigError(f"--out {self.path}: no such directory {self.path.parent}")
        try:
            self._recover()
            self._file = open(self.path, "ab")
        except OSError as error:
            raise ConfigError(f"--out {self.path}: cannot write it ({error.strerror or error})") from None

    def _recover(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        good, lines, kept, dropped = 0, raw.splitlines(keepends=True), [], 0
        for number, line in enumerate(lines, start=1):
            record = _complete_record(line)
            if record is None:
                if number == len(lines) and not line.endswith(b"\n"):
                    break           # the last record's write was cut short: it is written again
                raise ConfigError(f"--out {self.path}: line {number} is not a record of tierkv batch (another "
                                  "kind of file, or edited by hand); give a new .jsonl file, or remove that line")
            if self.job is not None and record.get("job", self.job) != self.job:
                raise ConfigError(f"--out {self.path}: line {number} was made with {self._other(record)}; resume "
                                  "with the settings that wrote it, or give a new --out")
            good += len(line)
            if self.retry_failed and failed_while_running(record):
                dropped += 1
                continue
            self.done.add(str(record["id"]))
            kept.append(line)
        if dropped:
            self._rewrite(b"".join(kept))
        elif good < len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())

    def _other(self, record: dict[str, Any]) -> str:
        """What differs between the settings that made ``record`` and this run's, in words."""
        made = record.get("settings")
        differ = [name for name in self.shown if name in made and made[name] != self.shown[name]] \
            if isinstance(made, dict) else []
        if not differ:                   # a record without its settings (older), or differing in a setting no
            shown = ", ".join(f"{name} {value!r}" for name, value in self.shown.items())        # longer made
            return f"settings other than this run's (this run: {shown})"
        return ", ".join(f"{name} {made[name]!r} where this run has {self.shown[name]!r}" for name in differ)

    def _rewrite(self, data: bytes) -> None:
        """The file as ``data``, whole or not at all (a new file renamed over it)."""
        scratch = self.path.with_name(f".{self.path.name}.retry")
        with open(scratch, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def write(self, record: dict[str, Any]) -> None:
        if self.job is not None:
            record = {**record, "job": self.job, "settings": self.shown}
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        try:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:          # (a line cut short is cut off by the next run, and redone)
            kind = DiskFullError if error.errno == errno.ENOSPC else OSError
            raise kind(error.errno, f"--out {self.path}: {error.strerror or error}; the same command again goes "
                                    "on from the documents written") from None
        self.done.add(str(record["id"]))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> OutputLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def finished(path: Path, *, retry_failed: bool = False) -> set[str]:
    """The ids an output holds records of, read without changing it (as ``OutputLog`` would take them;
    lines that are no record are left for it to judge)."""
    try:
        lines = Path(path).read_bytes().splitlines(keepends=True)
    except OSError:
        return set()
    records = [r for r in map(_complete_record, lines) if r is not None]
    return {str(r["id"]) for r in records if not (retry_failed and failed_while_running(r))}


def failed_while_running(record: dict[str, Any]) -> bool:
    """The record says its document failed while it ran (``--retry-failed`` runs it again)."""
    return str(record.get("error", "")).startswith(FAILED)


def _complete_record(line: bytes) -> dict[str, Any] | None:
    """A whole line of an output: an id and its summary or its error (a document's line is not one)."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "id" in record and ("summary" in record or "error" in record) \
        else None
