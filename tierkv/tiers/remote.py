"""A remote KV store shared by many machines: Redis or Valkey, reached with redis-py.

    redis://[:password@]host:port[/db]      rediss:// for TLS

Blocks are content-addressed by the same keys as the NVMe store, under the store's namespace::

    tierkv:<namespace>:b:<key hex>       value = frame(key, payload)
    tierkv:<namespace>:f:<name>          a named file (a sparse index): its part count, framed
    tierkv:<namespace>:f:<name>:<i>      its parts of at most 64 MiB, each framed
    tierkv:<namespace>:files             the set of those names

    frame = b"TKV1" | u32 payload bytes | u64 xxh3-64(key | payload) | payload

The checksum covers the key too, so a value under another key (or cut short, or flipped) never
passes. A value that fails it (a key of another type too) is deleted and reported as a miss: the
caller recomputes. A frame of another version (``TKV`` and another digit) is a miss too, and not
deleted.

A remote is a helper, never a dependency: every call has a short timeout, and an error (down,
a TLS or auth failure) marks it unavailable for ``retry_s``: it is logged once, and meanwhile every
read misses and every write is skipped. A refused write (a full Redis under ``noeviction``) skips
writes, not reads, for ``retry_s``. ``stats`` counts it all.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import xxhash

from tierkv.errors import ConfigError
from tierkv.keys import BlockKey

log = logging.getLogger(__name__)
MAGIC = b"TKV1"
HEADER = struct.Struct("<4sIQ")
SCHEMES = ("redis", "rediss")
FILE_PART = 64 * 1024**2
PIPELINE = 512                 # commands per round trip


def check_url(url: str, flag: str = "--remote") -> str:
    """``url`` if it names a Redis/Valkey server tierkv can use; a ConfigError saying what is allowed if not."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"{flag} {url!r}: expected redis://[:password@]host:port[/db] or rediss://... (TLS)")
    try:
        parts.port                     # noqa: B018 (parsing it is the check)
    except ValueError:
        raise ConfigError(f"{flag} {url!r}: the port is not a number") from None
    if not parts.hostname:
        raise ConfigError(f"{flag} {url!r}: no host (redis://host:6379)")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"{flag} {url!r}: the database after the host is a number (redis://host:6379/0)")
    if parts.query or parts.fragment:   # (options there would override the client's own: decoding, timeouts)
        raise ConfigError(f"{flag} {url!r}: no options after the database (redis://host:6379/0); tierkv sets "
                          "the client's options itself")
    return url


def safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"***@{netloc}").geturl()


def frame(key: bytes, payload: bytes | memoryview) -> bytes:
    digest = xxhash.xxh3_64(key)
    digest.update(payload)
    return HEADER.pack(MAGIC, len(payload), digest.intdigest()) + bytes(payload)


def foreign(value: bytes) -> bool:
    """``value`` is a frame of another version (``TKV`` and another digit): not ours to judge damaged or
    to delete, and it reads as missing. Anything else that is not a whole frame of ours (cut short,
    overwritten) is damaged."""
    return len(value) >= len(MAGIC) and value[:3] == MAGIC[:3] and value[3:4].isdigit() and \
        value[3:4] != MAGIC[3:4]


def _wrong_type(value, redis):
    """A read's answer for one key: a key holding another type (a list, a set) reads as a damaged value of
    that key alone (b""); any other error (a read-only replica, a failed save) is the server's, raised."""
    if isinstance(value, redis.ResponseError):
        if str(value).startswith("WRONGTYPE"):
            return b""
        raise value
    return value


def unframe(key: bytes, value: bytes, size: int | None = None) -> bytes | None:
    """The payload of ``value``, or None where it is not a whole, intact frame of ``key`` (of ``size`` bytes)."""
    if len(value) < HEADER.size:
        return None
    magic, length, checksum = HEADER.unpack_from(value)
    payload = memoryview(value)[HEADER.size:]
    if magic != MAGIC or length != len(payload) or (size is not None and length != size):
        return None
    digest = xxhash.xxh3_64(key)
    digest.update(payload)
    return bytes(payload) if digest.intdigest() == checksum else None


@dataclass(slots=True)
class RemoteStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0           # values that failed their checksum (deleted, recomputed)
    written: int = 0
    write_bytes: int = 0
    read_bytes: int = 0
    read_s: float = 0.0        # wall time of the reads that returned data
    skipped: int = 0           # writes not made: the remote unavailable, or the write queue full
    slower: int = 0            # blocks not read: the link would bring them slower than recomputing them
    errors: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class Link:
    """What a read of ``n`` bytes costs: ``rtt_s + n / bytes_per_s`` (measured; see ``probe``)."""
    rtt_s: float
    bytes_per_s: float

    def read_s(self, nbytes: int, round_trips: int = 1) -> float:
        return round_trips * self.rtt_s + nbytes / self.bytes_per_s


@dataclass
class RemoteStore:
    """Blocks of ``block_bytes`` (or named files) in a Redis/Valkey server, each with a time to live."""

    url: str
    namespace: str = "default"
    ttl_s: int = 7 * 24 * 3600
    timeout_s: float = 2.0
    retry_s: float = 30.0
    stats: RemoteStats = field(default_factory=RemoteStats)

    def __post_init__(self) -> None:
        check_url(self.url)
        import redis
        self._redis = redis
        self._client = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                            socket_connect_timeout=self.timeout_s, health_check_interval=30)
        self._prefix = f"tierkv:{self.namespace}:".encode()
        self._down_until = 0.0
        self._told_until = 0.0         # a refusal is logged again after this
        self._writes_until = 0.0       # a refused write (a full Redis): no writes are sent before this
        self._lock = threading.Lock()
        self.link: Link | None = None

    @property
    def name(self) -> str:
        return safe_url(self.url)

    # -- health ---------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception, doing: str) -> None:
        with self._lock:
            self.stats.errors += 1
            self.stats.last_error = f"{doing}: {error}"
            was_up = self._down_until <= time.monotonic()
            self._down_until = time.monotonic() + self.retry_s
        if was_up:
            log.warning("remote store %s unavailable (%s: %s); going on with the local tiers, trying it again "
                        "in %.0f s", self.name, doing, error, self.retry_s)

    def _refused(self, error: Exception, doing: str) -> None:
        """The server answered with an error (a write refused under ``maxmemory`` with ``noeviction``):
        it is up, so reads go on, and writes wait a retry period (each would be refused, after sending its
        bytes); counted, and logged once a retry period."""
        with self._lock:
            self.stats.errors += 1
            self.stats.last_error = f"{doing}: {error}"
            if doing == "write":
                self._writes_until = time.monotonic() + self.retry_s
            tell = self._told_until <= time.monotonic()
            if tell:
                self._told_until = time.monotonic() + self.retry_s
        if tell:
            log.warning("remote store %s refused %s (%s); going on without it", self.name, doing, error)

    def _call(self, doing: str, fn, default):
        if not self.available:
            return default
        try:
            return fn()
        except self._redis.ResponseError as e:
            self._refused(e, doing)
            return default
        except (self._redis.RedisError, OSError) as e:
            self._failed(e, doing)
            return default

    # -- blocks ---------------------------------------------------------------------------
    def block_name(self, key: BlockKey) -> bytes:
        return self._prefix + b"b:" + key.hex().encode()

    def get_many(self, keys: Sequence[BlockKey], size: int) -> list[bytes | None]:
        """Each block's payload (``size`` bytes, checksum verified), None where it is missing, damaged or
        the remote unavailable. A read refreshes a block's time to live."""
        if not keys or not self.available:
            return [None] * len(keys)
        names = [self.block_name(k) for k in keys]

        def read() -> list:
            values = []
            for first in range(0, len(names), PIPELINE):
                pipe = self._client.pipeline(transaction=False)
                for name in names[first:first + PIPELINE]:
                    pipe.getex(name, ex=self.ttl_s)
                values += [_wrong_type(v, self._redis) for v in pipe.execute(raise_on_error=False)]
            return values
        began = time.perf_counter()
        values = self._call("read", read, [None] * len(keys))
        out: list[bytes | None] = []
        damaged = []
        for key, name, value in zip(keys, names, values):
            payload = None if value is None else unframe(bytes(key), value, size)
            if value is not None and payload is None and not foreign(value):
                damaged.append(name)
            out.append(payload)
        found = sum(p is not None for p in out)
        with self._lock:
            self.stats.hits += found
            self.stats.misses += len(keys) - found
            self.stats.corrupt += len(damaged)
            if found:
                self.stats.read_bytes += found * size
                self.stats.read_s += time.perf_counter() - began
        if damaged:
            log.warning("remote store %s: %d block(s) failed their checksum; deleted, recomputing them",
                        self.name, len(damaged))
            self._call("delete", lambda: self._client.delete(*damaged), 0)
        return out

    @property
    def writable(self) -> bool:
        """Up, and no write refused within a retry period."""
        return self.available and time.monotonic() >= self._writes_until

    def put_many(self, items: Sequence[tuple[BlockKey, bytes | memoryview]]) -> bool:
        """Store blocks (one pipelined round trip); False where the remote refused or is unavailable."""
        if not items:
            return True
        if not self.writable:
            with self._lock:
                self.stats.skipped += len(items)
            return False

        def write() -> bool:
            for first in range(0, len(items), PIPELINE):
                pipe = self._client.pipeline(transaction=False)
                for key, payload in items[first:first + PIPELINE]:
                    pipe.set(self.block_name(key), frame(bytes(key), payload), ex=self.ttl_s)
                pipe.execute()
            return True
        ok = self._call("write", write, False)
        with self._lock:
            if ok:
                self.stats.written += len(items)
                self.stats.write_bytes += sum(len(p) for _, p in items)
            else:
                self.stats.skipped += len(items)
        return ok

    # -- named files (sparse indexes) ------------------------------------------------------
    def put_file(self, name: str, payload: bytes) -> bool:
        """Store a file in parts of ``FILE_PART`` bytes (a Redis value holds at most 512 MB), its part count
        written last, so a reader never sees part of it."""
        if not self.writable:
            return False
        base = self._prefix + b"f:" + name.encode()
        parts = [payload[i:i + FILE_PART] for i in range(0, len(payload), FILE_PART)] or [b""]

        def write() -> bool:
            for i, part in enumerate(parts):
                self._client.set(base + b":%d" % i, frame(name.encode() + b":%d" % i, part), ex=self.ttl_s)
            pipe = self._client.pipeline(transaction=True)
            pipe.set(base, frame(name.encode(), struct.pack("<I", len(parts))), ex=self.ttl_s)
            pipe.sadd(self._prefix + b"files", name)
            pipe.execute()
            return True
        return self._call("write", write, False)

    def get_file(self, name: str) -> bytes | None:
        """The file's bytes, every part verified; None where it is missing, damaged (then deleted) or the
        remote unavailable."""
        base = self._prefix + b"f:" + name.encode()

        def read() -> list | None:
            head = self._client.getex(base, ex=self.ttl_s)     # (its time to live kept in step with its parts')
            count = None if head is None else unframe(name.encode(), head, 4)
            if count is None:
                return None if head is None or foreign(head) else [None]
            pipe = self._client.pipeline(transaction=False)
            for i in range(struct.unpack("<I", count)[0]):
                pipe.getex(base + b":%d" % i, ex=self.ttl_s)
            return [unframe(name.encode() + b":%d" % i, v) if v is not None else None     # (a head of ours
                    for i, v in enumerate(pipe.execute())]                               # has parts of ours)
        parts = self._call("read", read, None)
        if parts is None:
            return None
        if any(p is None for p in parts):
            with self._lock:
                self.stats.corrupt += 1
            log.warning("remote store %s: file %s is damaged or incomplete; deleted", self.name, name)
            self._call("delete", lambda: self._client.delete(base), 0)
            self._call("delete", lambda: self._client.srem(self._prefix + b"files", name), 0)
            return None
        return b"".join(parts)

    def file_names(self, prefix: str = "") -> list[str]:
        names = self._call("list", lambda: self._client.smembers(self._prefix + b"files"), set())
        return sorted(n.decode() for n in names if n.decode().startswith(prefix))

    # -- the link ---------------------------------------------------------------------------
    def probe(self, nbytes: int = 4 * 1024**2, repeats: int = 5) -> Link | None:
        """Measure the round trip (PING) and the read throughput (a ``nbytes`` value written, read back
        and deleted); None where the remote is unavailable."""
        name = self._prefix + b"probe:" + str(time.time_ns()).encode()

        def measure() -> Link:
            rtts = []
            for _ in range(repeats):
                began = time.perf_counter()
                self._client.ping()
                rtts.append(time.perf_counter() - began)
            self._client.set(name, b"\0" * nbytes, ex=60)
            reads = []
            try:
                for _ in range(max(1, repeats // 2)):
                    began = time.perf_counter()
                    self._client.get(name)
                    reads.append(time.perf_counter() - began)
            finally:
                self._client.delete(name)
            rtt = sorted(rtts)[len(rtts) // 2]
            return Link(rtt, nbytes / max(min(reads) - rtt, 1e-6))
        self.link = self._call("probe", measure, None)
        return self.link

    def measured_link(self) -> Link | None:
        """The link as this run's reads saw it (throughput), else the probe's."""
        s = self.stats
        if s.read_bytes >= 1024**2 and self.link is not None:
            return Link(self.link.rtt_s, s.read_bytes / max(s.read_s, 1e-6))
        return self.link

    def info(self) -> dict[str, object]:
        """The server's version, memory in use and cap, and eviction policy (for reports)."""
        def ask() -> dict:
            server, memory = self._client.info("server"), self._client.info("memory")
            return {"version": server.get("redis_version") or server.get("valkey_version"),
                    "used_memory": memory.get("used_memory"), "maxmemory": memory.get("maxmemory"),
                    "maxmemory_policy": memory.get("maxmemory_policy")}
        return self._call("info", ask, {})

    def close(self) -> None:
        self._client.close()
