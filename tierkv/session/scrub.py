"""A whole store checked, and repaired where it can be: ``tierkv store verify|repair --nvme-dir DIR``.

    verify    every block of every NVMe store under DIR read and checked against its checksum;
              every stored sparse index, checkpoint and restore point checked whole (tensors and
              metadata); every page an index names looked up and its check taken from the first
    repair    the blocks that failed are dropped (journaled: no later run reads them); each stored
              document whose pages were damaged or lost is loaded and its pages computed again
              (``tierkv.session.repair``), with the model and the settings of the run that
              stored it; an index that fails its checks is removed (the next run prefills that
              document again); dense blocks are left dropped (a run computes a missing block
              again where it needs it)

Nothing here serves KV; verify writes nothing (it reads each store without joining it, as its
processes would see it), so a store in use by a running process can be verified, and repaired
too (drops are journaled for every process).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tierkv.errors import ConfigError, StoreUnusable
from tierkv.keys import BlockKey
from tierkv.layout import is_layout_name
from tierkv.model.loading import LoadedModel
from tierkv.model.settings import SessionConfig
from tierkv.session.prefill import shelf_of, stored_state
from tierkv.session.repair import Repair
from tierkv.session.session import Session
from tierkv.sparse.store import checked, index_name_problem, index_settings, read_checked_meta, read_ids
from tierkv.tiers.nvme import NvmeTier
from tierkv.tiers.journal import RECORD_BYTES
from tierkv.tiers.nvme_scan import Scan, scan_journal, scan_read_only
from tierkv.tiers.nvme_manifest import (REBUILD, UNUSABLE, ManifestDamaged, foreign_manifest, is_foreign,
                                        read_manifest)

INDEXES = "sparse-indexes"


@dataclass(slots=True)
class StoreCheck:
    directory: Path
    blocks: int = 0
    damaged: list[BlockKey] = field(default_factory=list)    # failed their checksum
    lost: int = 0                 # blocks whose slots lie past the end of slots.dat (the file was cut short)
    bad_records: int = 0          # journal records damaged in the middle: the blocks they put are lost
    torn_bytes: int = 0           # journal records a crash cut short at its end: writes never completed (sound)
    no_journal: bool = False      # index.log missing beside a slots.dat that held blocks: they are lost
    no_data: bool = False         # slots.dat missing: the blocks the journal names are lost
    problem: str | None = None    # the store cannot be read at all (its store.json)
    advice: str = UNUSABLE        # what to do about the problem
    shared: bool = False          # a repair found another process with the store open: lost blocks only hidden
    size_suspect: bool = False    # every block of several failed, and store.json has no checksum: its
                                  # block size is likely not the one they were written with (nothing dropped)
    foreign: str | None = None    # store.json names another namespace than the store's folder: it is another
                                  # store's (nothing dropped where blocks also fail or lie past the data's end)
    kept: bool = False            # a repair dropped nothing: the store's block size is in doubt (see above)

    @property
    def clean(self) -> bool:
        return not (self.damaged or self.lost or self.bad_records or self.problem or self.no_journal or self.foreign)

    def line(self, drop: bool) -> str:
        if self.problem:
            return f"store {self.directory.name}: unusable ({self.problem}){self.advice}"
        gone = "lost"
        if drop and not self.kept:
            gone = "hidden from this repair: another process has the store open (repair again once it has " \
                   "closed it)" if self.shared else "dropped"
        return f"store {self.directory.name}: {self.blocks} blocks, " + \
            (f"{len(self.damaged)} damaged" if self.damaged else "all sound") + \
            ("; those in another opener's slots are only hidden from this repair (it drops them as it reads them)"
             if self.damaged and drop and self.shared and not self.kept else "") + \
            (": every one, which damage does not do block by block; the block size in store.json is likely not "
             "the one they were written with" + ("; nothing dropped" if drop else "") if self.size_suspect else "") + \
            (f"; {self.foreign}" + ("; nothing dropped" if drop else "") + REBUILD if self.foreign else "") + \
            (f"; {self.lost} {gone}: " + ("slots.dat, the file that held them, is missing" if self.no_data else
                                          "their slots lie past the end of slots.dat (the file was cut short)")
             if self.lost and not self.foreign else "") + \
            ("; index.log is missing: the blocks slots.dat held are lost (no journal names them)"
             if self.no_journal else "") + \
            (f"; {self.bad_records} damaged journal record(s): the blocks they stored are {gone}"
             if self.bad_records else "") + \
            (f"; the journal's last {_records(self.torn_bytes)} unreadable: writes a crash stopped (blocks they "
             "stored are lost, as the newest blocks are when a machine stops)" if self.torn_bytes else "")


@dataclass(slots=True)
class IndexCheck:
    path: Path
    kind: str                         # index, checkpoint, restore point
    tokens: int = 0
    problem: str | None = None        # the file fails its checks
    pages: int = 0                    # pages it names (an index)
    bad_pages: list[BlockKey] = field(default_factory=list)  # of those, missing or damaged
    repair: Repair | None = None
    note: str | None = None           # what a repair did not do, and why


@dataclass(slots=True)
class Verdict:
    stores: list[StoreCheck] = field(default_factory=list)
    indexes: list[IndexCheck] = field(default_factory=list)
    seconds: float = 0.0

    repaired: bool = False        # blocks that failed were dropped

    @property
    def clean(self) -> bool:
        return all(s.clean for s in self.stores) and not any(i.problem or i.bad_pages for i in self.indexes)

    def lines(self) -> list[str]:
        out = [s.line(self.repaired) for s in self.stores]
        for i in self.indexes:
            parts = [] if i.problem else [f"{i.tokens} tokens"]           # (a file that fails: not known)
            if i.problem:
                parts.append(f"unusable ({i.problem})")
            elif i.kind == "index":
                parts.append(f"{i.pages} pages" + (f", {len(i.bad_pages)} missing or damaged" if i.bad_pages else ""))
            what = f"{i.kind} {i.path.name}: " + ", ".join(parts)
            if i.repair is not None:
                what += f"; repaired: {i.repair}"
            if i.note:
                what += f"; {i.note}"
            out.append(what)
        recomputed = any(i.repair is not None for i in self.indexes)
        if self.repaired and (recomputed or not self.clean):
            verdict = "damage found; the check after the repair says what is left"
        else:
            verdict = "clean" if self.clean else "DAMAGED"
        out.append(f"{verdict} ({self.seconds:.1f} s)")
        return out


def _records(nbytes: int) -> str:
    """``nbytes`` of the journal, in its records (48 bytes each) where there are whole ones."""
    whole = nbytes // RECORD_BYTES
    return f"{nbytes} bytes ({whole} record{'s' * (whole != 1)})" if whole else f"{nbytes} bytes (part of a record)"


def stores_in(nvme_dir: Path) -> list[Path]:
    """The stores under ``nvme_dir``: folders with a store.json, or with a store's data without one, and
    folders named like a store that this user cannot read (a glob passes over them, saying nothing)."""
    unreadable = {p for p in Path(nvme_dir).glob("*") if is_layout_name(p.name) and p.is_dir()
                  and not os.access(p, os.R_OK | os.X_OK)}
    return sorted(unreadable | {p.parent for name in ("store.json", "slots.dat", "index.log")
                                for p in Path(nvme_dir).glob(f"*/{name}")})


def verify(nvme_dir: Path, *, drop: bool = False, batch: int = 64) -> Verdict:
    """Check everything under ``nvme_dir``, writing nothing there (`scan_read_only`); ``drop``: join each
    store and drop the blocks that fail (and those an opener drops: past the data file's end)."""
    start, verdict = time.perf_counter(), Verdict(repaired=drop)
    if not Path(nvme_dir).is_dir():
        raise ConfigError(f"--nvme-dir {nvme_dir}: " + ("not a directory" if Path(nvme_dir).exists()
                                                        else "no such directory"))
    try:
        os.listdir(nvme_dir)
    except OSError as error:
        raise ConfigError(f"--nvme-dir {nvme_dir}: cannot read it ({error.strerror or error}); a store's directory "
                          "must belong to the user who checks it (tierkv makes it 0700)") from None
    if not stores_in(nvme_dir):      # nothing checked is not "clean"
        hint = f"; give the directory above it ({Path(nvme_dir).resolve().parent})" \
            if (Path(nvme_dir) / "store.json").is_file() else ""
        raise ConfigError(f"--nvme-dir {nvme_dir}: no tierkv store in it (a store is a folder with a "
                          f"store.json, as --nvme-dir of tierkv run makes){hint}")
    sound: dict[str, set[BlockKey]] = {}     # the sound keys of each store, by its folder's name
    for directory in stores_in(nvme_dir):
        check = StoreCheck(directory)
        try:
            manifest = read_manifest(directory)
            unchecked = "check" not in manifest                   # (a store made before store.json had one)
            foreign = is_foreign(directory, manifest)
            scan = scan_read_only(directory) if not drop or unchecked or foreign else None
            if scan is not None and drop and _doubtful(scan, foreign):
                check.kept = True               # its block size may not be its blocks': nothing is dropped
            elif drop:                          # (the journal read before the join drops what is lost)
                scan = scan_journal(directory)
                scan.keys, scan.damaged, check.shared = _drop_damaged(directory, batch)
        except ConfigError as error:            # (its store.json): the others are checked all the same
            check.problem = str(error).removeprefix(f"NVMe store {directory}: ").removesuffix(UNUSABLE)
            if isinstance(error, ManifestDamaged):
                check.problem, check.advice = check.problem.removesuffix(REBUILD), REBUILD
            elif isinstance(error, StoreUnusable):          # (its message says what to change)
                check.advice = ""
        else:
            check.blocks, check.damaged, check.lost = len(scan.keys), scan.damaged, len(scan.lost)
            check.bad_records, check.torn_bytes = scan.bad_records, scan.torn_bytes
            check.no_journal, check.no_data = scan.no_journal, scan.no_data
            check.size_suspect = unchecked and _doubtful(scan, False)
            check.foreign = foreign_manifest(manifest) if foreign else None
            sound[directory.name] = set(scan.keys).difference(scan.damaged)
        verdict.stores.append(check)
    folder = Path(nvme_dir, INDEXES)
    if folder.exists() and not folder.is_dir():
        verdict.indexes.append(IndexCheck(folder, "index folder", problem="not a folder: no document can be "
                                          "stored; move it aside"))
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        verdict.indexes.append(_check_index(path, sound))
    verdict.seconds = time.perf_counter() - start
    return verdict


def _doubtful(scan: Scan, foreign: bool) -> bool:
    """Whether what ``scan`` found says the store's block size is not its blocks': every block of several
    failing (a store.json without a checksum may have had its block size changed), or, where store.json is
    another store's (``foreign``), any block failing or lying past the data file's end. Such a store is
    not opened to drop anything (an opener drops the blocks past the end for good), and a run reads no
    block that fails its checksum all the same."""
    if foreign:
        return bool(scan.damaged or scan.lost)
    return len(scan.damaged) == len(scan.keys) > 1


def _drop_damaged(directory: Path, batch: int) -> tuple[list[BlockKey], list[BlockKey], bool]:
    """The store's keys and those of its blocks that fail their checksum, dropped, read through the store
    (joining it, as any process that uses it: the drops are journaled for every process); and whether
    another process had it open (then the blocks lost to a short data file are only hidden here)."""
    with NvmeTier.existing(directory) as tier:
        shared = not tier.opened_alone
        items = sorted(tier.items(), key=lambda item: item[1])
        damaged: list[BlockKey] = []
        data = torch.empty(min(batch, len(items)), tier.block_bytes, dtype=torch.uint8)
        for first in range(0, len(items), batch):
            group = items[first:first + batch]
            damaged += tier.read([(key, slot, data[i]) for i, (key, slot) in enumerate(group)])
        for key in damaged:
            tier.drop(key)
        tier.flush()
    return [key for key, _ in items], damaged, shared


def _check_index(path: Path, sound: dict[str, set[BlockKey]]) -> IndexCheck:
    """``path`` checked, and its pages looked for in the store of its page layout (an index of an earlier
    version, which does not name it: in any store)."""
    name = path.name.removesuffix(".safetensors")
    kind = "checkpoint" if name.endswith(".partial") else "restore point" if ".restore-" in name else "index"
    check = IndexCheck(path, kind)
    if not path.is_file():
        check.problem = "not a file"
        return check
    try:
        with safe_open(str(path), framework="pt", backend="pread") as f:
            meta, sums = read_checked_meta(f)
            ids = None
            for tensor, digest in sums.items():
                read = checked(f, tensor, digest)
                ids = read.tolist() if tensor == "ids" else ids
        check.tokens = max(json.loads(meta["tokens"])) if meta["tokens"].startswith("[") else int(meta["tokens"])
        root = BlockKey(bytes.fromhex(name.split(".")[0].split("-")[2]))     # <identity>-<tokens>-<root>
        settings = json.loads(meta.get("settings") or "null")
        store = settings.get("pages") if isinstance(settings, dict) else None
        if kind == "index" and ids is not None:
            check.problem = index_name_problem(path, meta, ids)
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError, IndexError) as error:
        check.problem = str(error)
        return check
    if check.problem:
        return check
    if kind == "index":
        keys = [BlockKey.of(root.digest, "page", layer, page)
                for layer, n in enumerate(json.loads(meta["pages"])) for page in range(n)]
        held = sound.get(store, set()) if isinstance(store, str) else set().union(*sound.values())
        check.pages, check.bad_pages = len(keys), [key for key in keys if key not in held]
    return check


def repair_store(nvme_dir: Path, config: SessionConfig, *, loaded: LoadedModel | None = None) -> Verdict:
    """``verify`` dropping what fails, then each damaged document computed again (see the module notes),
    with ``config``'s model (or ``loaded``) and sparse settings."""
    start = time.perf_counter()
    config = replace(config, tiers=replace(config.tiers, nvme_dir=Path(nvme_dir)))
    before = set(stores_in(nvme_dir))
    try:
        if any(_manifest_damaged(directory) for directory in before):
            loaded = _rebuild_manifests(config, loaded)          # (its model serves the repair below too)
            _remove_made(nvme_dir, before)
        verdict = verify(nvme_dir, drop=True)
        broken = [i for i in verdict.indexes if i.problem or i.bad_pages]
        for check in [i for i in broken if not i.path.is_file()]:   # a folder or a device where a file belongs:
            check.note = "not repaired: move it aside"               # not this repair's to remove
            broken.remove(check)
        if broken:
            with Session(config, loaded=loaded) as session:
                backend = session.backend("sparse")
                shelf = shelf_of(backend.engine, nvme_dir)
                for check in broken:
                    _repair_one(check, backend.engine, shelf)
    finally:
        _remove_made(nvme_dir, before)
    verdict.seconds = time.perf_counter() - start
    return verdict


def _manifest_damaged(directory: Path) -> bool:
    """Whether store.json is damaged, or names another namespace than the store's folder."""
    try:
        return is_foreign(directory, read_manifest(directory))
    except ManifestDamaged:
        return True
    except ConfigError:
        return False


def _rebuild_manifests(config: SessionConfig, loaded: LoadedModel | None) -> LoadedModel:
    """Open the stores of ``config``'s settings (dense and sparse): opening one whose store.json is damaged
    rebuilds it where its blocks vouch for the settings (`nvme_share.check_manifest`); one they do not
    vouch for stays unusable, and the check after says so. Returns the model it loaded."""
    with Session(config, loaded=loaded) as session:
        for mode in ("dense", "sparse"):
            with contextlib.suppress(ManifestDamaged):
                session.backend(mode)
        return session.loaded


def _remove_made(nvme_dir: Path, before: set[Path]) -> None:
    """The stores a repair's opening made (of the settings given) that nothing went into, removed."""
    for made in set(stores_in(nvme_dir)) - before:
        _remove_if_unused(made)


def _remove_if_unused(directory: Path) -> None:
    """Remove the store in ``directory`` if it holds no block and no other process has it open."""
    with NvmeTier.existing(directory) as tier:
        unused = tier.opened_alone and next(iter(tier.items()), None) is None
    if unused:
        shutil.rmtree(directory)


def _differences(path: Path, engine, ids: list[int]) -> str:
    """The settings the index at ``path`` was stored with that differ from those ``engine`` would store
    ``ids`` with, where the index says them."""
    with safe_open(str(path), framework="pt", backend="pread") as f:
        stored = json.loads((f.metadata() or {}).get("settings", "null") or "null")
    if not isinstance(stored, dict):
        return ""
    given = json.loads(json.dumps(index_settings(engine.layout, engine.resolved(len(ids))), default=str))
    differ = [name for name, value in stored.items() if name != "pages" and given.get(name) != value]
    if "page_dtype" in differ and "page_tokens" in differ and stored["page_tokens"] == _own_page_tokens(engine, stored):
        differ.remove("page_tokens")        # (the stored page dtype's own page size: its flag gives it)
    if not differ and stored.get("pages") != given.get("pages"):
        differ = ["pages"]                  # the page layout alone: the model's shape, or --dtype / --page-dtype
    shown = [f"--{name.replace('_', '-')} {_shown(stored[name])} (given {_shown(given.get(name))})"
             if name != "pages" else f"pages {stored[name]} (given {given.get(name)})" for name in differ]
    return f" (stored with {', '.join(shown)})" if shown else " (the same sparse settings: another model, or --dtype)"


def _own_page_tokens(engine, stored: dict) -> int | None:
    """The page size the stored index's page dtype takes where no page size is given (None: not known)."""
    try:
        config = replace(engine.config, page_dtype=stored["page_dtype"], page_tokens=None)
        return engine.page_layout(engine.loaded, config).tokens
    except (ConfigError, TypeError):
        return None


def _shown(value: object) -> str:
    return "the default" if value is None else str(value)


def _repair_one(check: IndexCheck, engine, shelf) -> None:
    if check.problem:
        check.path.unlink(missing_ok=True)
        check.note = "removed: " + ("the next run prefills the document again" if check.kind == "index"
                                    else "a run goes on without it")
        return
    ids = read_ids(check.path)
    if ids is None:
        check.note = "not repaired: the index does not record its tokens (stored by an earlier version)"
    elif shelf.path(ids) != check.path:
        check.note = "not repaired: stored with another model or other sparse settings than given here" + \
            _differences(check.path, engine, ids)
    else:
        state = stored_state(engine, shelf, ids)       # drops made its damaged pages missing: repaired here
        if state is None:
            check.note = "not repaired: its pages could not be computed again (see the log)"
            return
        repairs = state.seq.origin.repairs
        check.repair, check.bad_pages = (repairs[-1] if repairs else None), []
        state.release()
