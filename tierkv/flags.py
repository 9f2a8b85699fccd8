"""Command-line flags made from settings dataclasses, so each default and help text is written once.

A settings field that a command exposes carries its flag in its metadata::

    gpu_budget: str | int = setting("256MiB", "KV bytes in the compute device's tier")
    reuse: bool = setting(True, "ignore KV stored by earlier runs", flag="--no-reuse")

``add_flags(parser, Settings)`` adds one flag per such field (``--gpu-budget``: the field's
name with dashes, unless ``flag`` says otherwise), its type taken from the annotation, its help
ending in the dataclass default. Every flag defaults to "not given", so ``given(args, Settings)``
returns exactly what the user typed; a settings object is then built from the dataclass
defaults, then a settings file (``--config``), then the flags, later ones winning::

    values = defaults  <-  file values (by field name)  <-  given(args, Settings)

A nested settings class (a field whose type is itself a settings dataclass) becomes an argument
group titled by its ``setting(title=...)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError

_NOT_GIVEN = None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
            aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None, metavar: str | None = None,
            exclusive: str | None = None, title: str | None = None, factory: Any = dataclasses.MISSING,
            show_default: bool = True, kind: type | None = None) -> Any:
    """A dataclass field exposed as a flag (``help`` empty and no ``title``: not exposed).

    ``flag="--no-X"`` on a bool whose default is True makes a switch that turns it off;
    ``exclusive`` names a group of flags of which at most one may be given; ``title`` marks a
    nested settings class (its flags form a group); ``kind``: what the flag parses to, where the
    annotation is not it (a field that parses its own text)."""
    meta = {"help": help, "flag": flag, "aliases": aliases, "choices": choices, "metavar": metavar,
            "exclusive": exclusive, "title": title, "show_default": show_default, "kind": kind}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """The flag's name as an identifier (``--sparse-budget`` -> ``sparse_budget``): the key of the
    parsed arguments and of a settings file, unique across a command's nested settings."""
    return flag_name(f)[2:].replace("-", "_")


def exposed(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (nested settings not included)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("help") and not f.metadata.get("title")]


def nested(cls: type) -> list[tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("title")]


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per exposed field of ``cls``; nested settings as argument groups."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in exposed(cls):
        exclusive = f.metadata["exclusive"]
        if exclusive and exclusive not in groups:
            groups[exclusive] = parser.add_mutually_exclusive_group()
        _add_flag(groups.get(exclusive, parser), f, hints[f.name])
    for f, inner in nested(cls):
        top = parser if isinstance(parser, argparse.ArgumentParser) else parser._container  # noqa: SLF001
        add_flags(top.add_argument_group(f.metadata["title"]), inner)


def _add_flag(parser: Any, f: dataclasses.Field, hint: Any) -> None:
    meta, names = f.metadata, [flag_name(f), *f.metadata["aliases"]]
    help_text = meta["help"]
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = meta["kind"] or _base_type(hint)
    if kind is bool:
        action = "store_false" if default else "store_true"
        parser.add_argument(*names, dest=dest(f), action=action, default=_NOT_GIVEN, help=help_text)
        return
    if meta["show_default"] and default not in (None, "", ()):
        help_text += f" (default {_shown(default)})"
    extra: dict[str, Any] = {"metavar": meta["metavar"], "choices": meta["choices"]}
    if kind is tuple:
        extra |= {"action": "append", "type": str}
    else:
        extra["type"] = path_arg if kind is Path else kind
    parser.add_argument(*names, dest=dest(f), default=_NOT_GIVEN, help=help_text.replace("%", "%%"), **extra)


def path_arg(text: str) -> Path:
    """A path argument's value (``type=path_arg``); an empty one (Path('') is '.': the working
    directory) is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a path")
    return Path(text)


def check_writable(flag: str, path: Path) -> None:
    """That a command may write the file ``path`` (given as ``flag``): said before its work, not after."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    if not path.parent.is_dir():
        above = next((p for p in path.parents if p.exists()), None)
        if above is not None and not above.is_dir():          # (run.json/x: run.json is a file)
            raise ConfigError(f"{flag} {path}: {above} is a file, not a directory")
        raise ConfigError(f"{flag} {path}: no such directory {path.parent}")
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{flag} {path}: a link to {os.readlink(path)}, which does not exist")
    existed = path.exists()
    try:                              # tried, not judged from permission bits: root passes those everywhere
        flags = os.O_WRONLY | (os.O_APPEND | os.O_NONBLOCK if existed else os.O_CREAT | os.O_EXCL)
        os.close(os.open(path, flags, 0o644))           # (a pipe with no reader fails, not blocks)
    except OSError as error:
        raise ConfigError(f"{flag} {path}: cannot write there ({error.strerror or error})") from None
    if not existed:
        path.unlink()


def _same_file(a: Path, b: Path) -> bool:
    """One file by two names (a link, a relative path): both may not exist yet."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_not_read(written: dict[str, Path | None], read: dict[str, Path | None]) -> None:
    """That no file written (by flag) is one read: a ConfigError naming both flags."""
    for out_flag, out in written.items():
        for in_flag, source in read.items():
            if out is not None and source is not None and _same_file(Path(out), Path(source)):
                raise ConfigError(f"{out_flag} {out}: is also the {in_flag} file, which this would overwrite; "
                                  "give another file")


def _base_type(hint: Any) -> type:
    """The type a flag parses to: the annotation without ``None``; str for unions of several."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _base_type(args[0]) if len(args) == 1 else str
    if typing.get_origin(hint) is tuple or hint is tuple:
        return tuple
    if hint in (int, float, bool, str, Path):
        return hint
    return str


def _shown(default: Any) -> str:
    return str(default)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The exposed fields of ``cls`` (nested included, as nested dicts) the command line set."""
    values = {f.name: tuple(v) if isinstance(v := getattr(args, dest(f)), list) else v
              for f in exposed(cls) if getattr(args, dest(f), _NOT_GIVEN) is not _NOT_GIVEN}
    for f, inner in nested(cls):
        if inner_values := given(args, inner):
            values[f.name] = inner_values
    return values


def given_flags(args: argparse.Namespace, cls: type) -> list[str]:
    """The flags of ``cls``'s own fields (not nested) that the command line set, by name."""
    return [flag_name(f) for f in exposed(cls) if getattr(args, dest(f), _NOT_GIVEN) is not _NOT_GIVEN]


def build(cls: type, *layers: Mapping[str, Any]) -> Any:
    """``cls`` from its defaults updated by each mapping in turn (nested settings as nested mappings)."""
    inner_types = {f.name: inner for f, inner in nested(cls)}
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in inner_types:
                values.setdefault(key, []).append(value)
            else:
                values[key] = value
    for key, inner in inner_types.items():
        values[key] = build(inner, *values.get(key, []))
    return cls(**values)


def dests(cls: type) -> dict[str, tuple[str, ...]]:
    """Every flag's dest (nested included) -> the path of field names that leads to it."""
    paths = {dest(f): (f.name,) for f in exposed(cls)}
    for f, inner in nested(cls):
        paths |= {key: (f.name, *path) for key, path in dests(inner).items()}
    return paths


def nest(cls: type, flat: Mapping[str, Any]) -> dict[str, Any]:
    """Values keyed by flag dest (a settings file, a library call) -> the nested mapping ``build``
    takes; an unknown key raises KeyError naming it, a value of the wrong type a ConfigError. A
    value means what its flag says: ``no_reuse=True`` is ``--no-reuse``, so the field ``reuse`` is
    False (argparse's ``store_false`` makes that turn for the command line)."""
    paths = dests(cls)
    unknown = sorted(set(flat) - set(paths))
    if unknown:
        raise KeyError(", ".join(unknown))
    accepted, negated = _accepted(cls), _negated(cls)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        kinds, name = accepted.get(key, ((object,), ""))
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ConfigError(f"{key}={value!r}: expected {name}")
        if key in negated:
            value = not value
        *outer, name = paths[key]
        node = out
        for part in outer:
            node = node.setdefault(part, {})
        node[name] = value
    return out


def _negated(cls: type) -> set[str]:
    """The dests of flags that turn a field off (``--no-reuse`` for ``reuse``, on by default)."""
    hints = typing.get_type_hints(cls)
    found = {dest(f) for f in exposed(cls) if hints[f.name] is bool and f.default is True
             and flag_name(f).startswith("--no-")}
    for f, inner in nested(cls):
        found |= _negated(inner)
    return found


_KINDS: dict[type, tuple[tuple[type, ...], str]] = {     # a field's type -> the values taken, as said
    bool: ((bool,), "true or false"), int: ((numbers.Integral,), "an integer"), float: ((numbers.Real,), "a number"),
    str: ((str, os.PathLike), "text"), Path: ((str, os.PathLike), "a path"), tuple: ((list, tuple), "a list")}


def _accepted(cls: type) -> dict[str, tuple[tuple[type, ...], str]]:
    """Every flag's dest -> the Python types its value may have and their name (a field of several
    types: not checked)."""
    hints = typing.get_type_hints(cls)
    found: dict[str, tuple[tuple[type, ...], str]] = {}
    for f in exposed(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        real = [a for a in args if a is not type(None)] if args and typing.get_origin(hint) is not tuple else [hint]
        kind = _KINDS.get(_base_type(real[0])) if len(real) == 1 and f.metadata["kind"] is None else None
        if kind is not None:
            kinds, name = kind
            found[dest(f)] = (kinds + (type(None),), f"{name} or None") \
                if type(None) in args or f.default is None else kind
    for f, inner in nested(cls):
        found |= _accepted(inner)
    return found


_FIELD = re.compile(r"([a-z][a-z0-9_]*)(?==|: )")
_NAMED = re.compile(r"(?<![\w.\['\"-])([a-z][a-z0-9]*_[a-z0-9_]+)(?==)")   # (quoted: the user's own text)


def as_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """A settings error names its fields (``chunk_tokens=100: must be a multiple of block_tokens=256``,
    as the library takes them); the command line says the flags they were given as (``--chunk-tokens=100:
    must be a multiple of --block-tokens=256``). Past the message's start only ``two_words=`` is taken for a
    field: a single word there (``policy='x'``) is as often a function's own argument."""
    dests = _flag_dests(parser)
    field = _FIELD.match(message)
    start = 0
    if field is not None and field[1] in dests:
        message, start = "--" + field[1].replace("_", "-") + message[field.end():], field.end() + 2
    rest = _NAMED.sub(lambda named: "--" + named[1].replace("_", "-") if named[1] in dests else named[0],
                      message[start:])
    return message[:start] + rest


def _flag_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The names of every option of ``parser`` and its commands, as settings fields spell them."""
    dests = set()
    for action in parser._actions:
        if action.option_strings and action.option_strings[0].startswith("--"):
            dests.add(action.option_strings[0][2:].replace("-", "_"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                dests |= _flag_dests(sub)
    return dests
