"""A store's manifest, ``store.json``: its format, block size and namespace, with a checksum of them
(a changed block size would read every block at other offsets). Read and checked (`read_manifest`),
written by the first opener (`check_manifest`), and rebuilt by an opener that knows the store's
settings where it is damaged, missing or another store's and the store's blocks vouch for those
settings (`_blocks_vouch`)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import xxhash

from tierkv.errors import ConfigError, StoreUnusable
from tierkv.layout import is_layout_name
from tierkv.tiers.journal import replay_store
from tierkv.tiers.nvme_io import fsync_dir
from tierkv.tiers.nvme_striped import checksum

log = logging.getLogger(__name__)

FORMAT = "tierkv-nvme"
VERSION = 1
_MANIFEST_FIELDS = ("format", "version", "block_bytes", "namespace")     # ("created" says nothing of the data)
UNUSABLE = "; move the store aside or remove it: a run makes a new one"


def _manifest_check(manifest: dict) -> str:
    """xxh3-64 over the manifest's own fields: a number changed in store.json (a disk's bit flip, an
    edit) would make every block read at other offsets, and every block fail its checksum."""
    fields = {name: manifest.get(name) for name in _MANIFEST_FIELDS}
    return xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True).encode())


class ManifestDamaged(ConfigError):
    """store.json is no manifest (not JSON, a field missing or of another type) or fails its checksum:
    its block size and namespace cannot be trusted. An opener that knows both rebuilds it where the
    store's blocks vouch for them (`check_manifest`)."""


REBUILD = "; a run with the settings that made it (or tierkv store repair with them) rebuilds it from its blocks"


def read_manifest(directory: Path) -> dict:
    """The store's store.json, checked: its fields there and of their types, its checksum (a manifest of
    a store made before it had one has none) and its format; ConfigError names what is wrong
    (ManifestDamaged where it is damaged)."""
    path = directory / "store.json"
    try:
        manifest = json.loads(path.read_text())
        form, version = manifest["format"], manifest["version"]
        if (form, version) == (FORMAT, VERSION):      # (another format's fields are its own)
            if not isinstance(manifest["block_bytes"], int) or manifest["block_bytes"] <= 0:
                raise ValueError(f"block_bytes={manifest['block_bytes']!r}")
            if not isinstance(manifest["namespace"], str):
                raise ValueError(f"namespace={manifest['namespace']!r}")
    except FileNotFoundError:
        raise ManifestDamaged(f"NVMe store {directory}: no store.json beside its data{REBUILD}") from None
    except PermissionError:
        raise StoreUnusable(f"NVMe store {directory}: no permission to read store.json; the store must belong to "
                            "this user (it is created 0700, files 0600)") from None
    except OSError as exc:
        raise ConfigError(f"NVMe store {directory}: unreadable store.json ({exc.strerror or exc})") from None
    except KeyError as exc:
        raise ManifestDamaged(f"NVMe store {directory}: unreadable store.json (no field {exc}){REBUILD}") from None
    except (ValueError, TypeError) as exc:
        raise ManifestDamaged(f"NVMe store {directory}: unreadable store.json ({exc}){REBUILD}") from None
    if (form, version) != (FORMAT, VERSION):
        raise ConfigError(f"NVMe store {directory}: format {form!r} v{version}; this tierkv reads {FORMAT!r} "
                          f"v{VERSION}")
    for name in ("slots.dat", "index.log"):       # a folder or a device in their place is no store's file
        if (directory / name).exists() and not (directory / name).is_file():
            raise ConfigError(f"NVMe store {directory}: {name} is not a file{UNUSABLE}")
    if "check" in manifest and manifest["check"] != _manifest_check(manifest):
        raise ManifestDamaged(f"NVMe store {directory}: store.json fails its checksum (damaged: its block size "
                              f"or namespace cannot be trusted, so no block of it is read){REBUILD}")
    return manifest


def check_manifest(directory: Path, block_bytes: int, namespace: str) -> None:
    path = directory / "store.json"
    if not path.exists():
        found = [name for name in ("slots.dat", "index.log") if (directory / name).exists()]
        vouched = _blocks_vouch(directory, block_bytes, namespace) if found else "it holds nothing"
        if vouched is None:
            raise ConfigError(f"NVMe store {directory}: has {', '.join(found)} but no store.json; "
                              f"not a tierkv store, or a damaged one{REBUILD}")
        if found:
            log.warning("NVMe store %s: no store.json; rebuilt it for block_bytes=%d, namespace=%r: %s", directory,
                        block_bytes, namespace, vouched)
        _write_manifest(path, block_bytes, namespace)
        return
    try:
        manifest = read_manifest(directory)
        if directory.name == namespace != manifest["namespace"]:      # the folder says whose store it is
            raise ManifestDamaged(f"NVMe store {directory}: {foreign_manifest(manifest)}{REBUILD}")
    except ManifestDamaged as damaged:
        vouched = _blocks_vouch(directory, block_bytes, namespace)
        if vouched is None:             # (these settings are not the ones that made it: no rebuild here)
            raise ManifestDamaged(f"{str(damaged).removesuffix(REBUILD)}; its blocks do not vouch for "
                                  f"block_bytes={block_bytes}, namespace={namespace!r}, the settings given: "
                                  "give those that made the store, or move it aside") from None
        log.warning("%s; rebuilt it for block_bytes=%d, namespace=%r: %s", str(damaged).removesuffix(REBUILD),
                    block_bytes, namespace, vouched)
        _write_manifest(path, block_bytes, namespace)
        return
    if (manifest["block_bytes"], manifest["namespace"]) != (block_bytes, namespace):
        raise ConfigError(f"NVMe store {directory} holds block_bytes={manifest['block_bytes']}, "
                          f"namespace={manifest['namespace']!r}; asked for block_bytes={block_bytes}, "
                          f"namespace={namespace!r}: open it with those values or use another directory")


def is_foreign(directory: Path, manifest: dict) -> bool:
    """Whether ``manifest`` names another namespace than its store's folder, where the folder is named
    as tierkv names a store's (after its layout's namespace): another store's store.json."""
    return manifest["namespace"] != directory.name and is_layout_name(directory.name)


def foreign_manifest(manifest: dict) -> str:
    """A store.json naming another namespace than its store's folder, in words."""
    return (f"store.json is another store's (namespace={manifest['namespace']!r}, block_bytes="
            f"{manifest['block_bytes']}): copied over this one's, or this folder renamed from that (then rename it "
            f"back)")


VOUCHING = 16       # blocks read to rebuild a damaged store.json: each must pass its checksum


def _blocks_vouch(directory: Path, block_bytes: int, namespace: str) -> str | None:
    """Why ``block_bytes`` and ``namespace`` are the store's own, or None where nothing says so: the store
    is named after its namespace (as every store tierkv makes), and up to ``VOUCHING`` of the blocks its
    journal names, spread over its slots, pass their checksums read at that block size (read at any
    other, no block passes); a store that holds no block has nothing to lose."""
    if directory.name != namespace:
        return None
    try:
        state = replay_store(directory, block_bytes)
        _, slots, sums = state.index.records()
        if not slots:
            return None if state.lost else "it holds no block"
        picked = sorted(set(np.linspace(0, len(slots) - 1, min(VOUCHING, len(slots))).astype(int).tolist()))
        with open(directory / "slots.dat", "rb", buffering=0) as f:
            if any(checksum(os.pread(f.fileno(), block_bytes, slots[i] * block_bytes)) != sums[i] for i in picked):
                return None
    except OSError:
        return None
    return f"{len(picked)} of its {len(slots)} blocks, read at that size, pass their checksums"


def _write_manifest(path: Path, block_bytes: int, namespace: str) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "block_bytes": block_bytes, "namespace": namespace,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    manifest["check"] = _manifest_check(manifest)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")     # (two openers may rebuild a damaged one at once)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (json.dumps(manifest, indent=2) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
