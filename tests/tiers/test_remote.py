"""The remote store against a real redis-server: framing, checksums, TTL, a server that dies, and the
manager's write-through and read-on-miss."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from tierkv.config import TierConfig
from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.manager.blocking import BlockingTierManager
from tierkv.manager.remote import Recompute
from tierkv.tiers.remote import FILE_PART, HEADER, RemoteStore, check_url, frame, safe_url, unframe

BLOCK = 4096


def block(fill: int) -> torch.Tensor:
    return torch.full((BLOCK,), fill, dtype=torch.uint8)


@pytest.mark.parametrize("url", ["http://host:6379", "redis://", "redis://host:port", "redis://host:6379/zero",
                                 "host:6379", "redis://host:6379/0?decode_responses=true"])
def test_bad_urls_say_what_is_allowed(url):
    with pytest.raises(ConfigError, match="redis://"):
        check_url(url)


def test_password_never_shown():
    assert safe_url("redis://:s3cret@host:6379/1") == "redis://***@host:6379/1"
    assert "s3cret" not in RemoteStore("redis://:s3cret@127.0.0.1:1/0").name


def test_frame_rejects_another_key_a_cut_and_a_flip():
    key, payload = BlockKey.of("a"), bytes(range(256)) * 16
    value = frame(key, payload)
    assert unframe(key, value, len(payload)) == payload
    assert unframe(BlockKey.of("b"), value) is None
    assert unframe(key, value[:-1]) is None
    assert unframe(key, value, len(payload) - 1) is None
    flipped = bytearray(value)
    flipped[HEADER.size + 7] ^= 1
    assert unframe(key, bytes(flipped)) is None


def test_blocks_round_trip_with_a_ttl(redis_server):
    store = RemoteStore(redis_server.url, "ns", ttl_s=600)
    keys = [BlockKey.of(i) for i in range(3)]
    assert store.put_many([(k, bytes([i]) * BLOCK) for i, k in enumerate(keys[:2])])
    got = store.get_many(keys, BLOCK)
    assert got == [b"\0" * BLOCK, b"\1" * BLOCK, None]
    assert (store.stats.hits, store.stats.misses, store.stats.written) == (2, 1, 2)
    assert 0 < redis_server.client().ttl(store.block_name(keys[0])) <= 600
    assert store.probe().bytes_per_s > 0


def test_a_damaged_value_is_never_served_and_is_deleted(redis_server):
    store = RemoteStore(redis_server.url, "ns")
    key = BlockKey.of("k")
    store.put_many([(key, b"\7" * BLOCK)])
    client = redis_server.client()
    value = bytearray(client.get(store.block_name(key)))
    value[-1] ^= 0xFF
    client.set(store.block_name(key), bytes(value))
    assert store.get_many([key], BLOCK) == [None]
    assert store.stats.corrupt == 1
    assert client.exists(store.block_name(key)) == 0


def test_a_value_overwritten_with_something_else_is_damaged_not_another_format(redis_server):
    store = RemoteStore(redis_server.url, "ns")
    key, client = BlockKey.of("k"), redis_server.client()
    store.put_many([(key, b"\7" * BLOCK)])
    client.set(store.block_name(key), b"garbage-not-a-frame")
    assert store.get_many([key], BLOCK) == [None] and store.stats.corrupt == 1
    assert client.exists(store.block_name(key)) == 0


def test_a_key_of_another_type_is_damaged_alone(redis_server):
    store = RemoteStore(redis_server.url, "ns")
    keys, client = [BlockKey.of("k", i) for i in range(3)], redis_server.client()
    store.put_many([(key, bytes([i]) * BLOCK) for i, key in enumerate(keys)])
    client.delete(store.block_name(keys[1]))
    client.lpush(store.block_name(keys[1]), b"x")              # a list where a block's value belongs
    assert store.get_many(keys, BLOCK) == [bytes([0]) * BLOCK, None, bytes([2]) * BLOCK]
    assert store.stats.corrupt == 1 and client.exists(store.block_name(keys[1])) == 0


def test_a_read_the_server_refuses_is_no_damage(redis_server):
    """An error for every key (here a user not allowed GETEX; a read-only replica, a failed save) is the
    server's: reads miss, nothing is called damaged or deleted."""
    client = redis_server.client()
    client.execute_command("ACL", "SETUSER", "reader", "on", ">pw", "~*", "+@all", "-getex")
    store = RemoteStore(redis_server.url.replace("redis://", "redis://reader:pw@"), "ns")
    keys = [BlockKey.of("k", i) for i in range(3)]
    store.put_many([(key, b"\1" * BLOCK) for key in keys])
    assert store.get_many(keys, BLOCK) == [None] * 3
    assert store.stats.corrupt == 0 and store.stats.errors == 1 and "getex" in store.stats.last_error
    assert all(client.exists(store.block_name(key)) for key in keys)


def test_a_value_in_another_format_is_a_miss_and_left_alone(redis_server):
    store = RemoteStore(redis_server.url, "ns")
    key, client = BlockKey.of("k"), redis_server.client()
    other = b"TKV2" + bytes(HEADER.size + BLOCK)             # a later version's frame, say
    client.set(store.block_name(key), other)
    client.set(b"tierkv:ns:f:idx", other)
    assert store.get_many([key], BLOCK) == [None] and store.get_file("idx") is None
    assert store.stats.corrupt == 0 and store.stats.misses == 1
    assert client.get(store.block_name(key)) == other and client.get(b"tierkv:ns:f:idx") == other


def test_a_damaged_part_of_a_file_deletes_the_file(redis_server):
    store = RemoteStore(redis_server.url, "ns")
    assert store.put_file("idx", b"x" * 100)
    client = redis_server.client()
    client.set(b"tierkv:ns:f:idx:0", b"XX")                 # cut short: ours, damaged (not another format)
    assert store.get_file("idx") is None and store.stats.corrupt == 1
    assert client.exists(b"tierkv:ns:f:idx") == 0 and store.file_names() == []


def test_a_files_head_lives_as_long_as_its_parts(redis_server):
    store = RemoteStore(redis_server.url, "ns", ttl_s=600)
    assert store.put_file("idx", b"x" * 100)
    client = redis_server.client()
    client.expire(b"tierkv:ns:f:idx", 5)
    assert store.get_file("idx") == b"x" * 100
    assert client.ttl(b"tierkv:ns:f:idx") > 500 and client.ttl(b"tierkv:ns:f:idx:0") > 500


def test_a_dead_server_is_reported_once_and_every_call_goes_on(redis_server, caplog):
    store = RemoteStore(redis_server.url, "ns", timeout_s=0.5, retry_s=60)
    key = BlockKey.of("k")
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers.remote"):
        assert store.get_many([key], BLOCK) == [None]
        assert not store.put_many([(key, b"x" * BLOCK)])
        assert store.get_file("f") is None
    assert not store.available
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    assert store.stats.errors == 1 and store.stats.skipped == 1


def test_a_full_server_skips_writes_and_reads_still_work(tmp_path):
    from redis_process import RedisServer
    server = RedisServer(tmp_path, maxmemory="2mb").start()
    try:
        store = RemoteStore(server.url, "ns", retry_s=0.5)   # (a refusal is no outage: reads go on)
        first = BlockKey.of("first")
        assert store.put_many([(first, b"1" * BLOCK)])
        big = [(BlockKey.of(i), bytes(BLOCK * 64)) for i in range(16)]       # 4 MiB: over the cap
        assert not store.put_many(big)
        assert "OOM" in store.stats.last_error or "maxmemory" in store.stats.last_error
        assert store.available and store.get_many([first], BLOCK) == [b"1" * BLOCK]
        second = [(BlockKey.of("second"), b"2" * BLOCK)]
        assert not store.put_many(second) and store.stats.errors == 1      # not sent: writes wait the period
        time.sleep(0.6)
        assert store.put_many(second) and store.get_many([second[0][0]], BLOCK) == [b"2" * BLOCK]
    finally:
        server.kill()


def test_files_in_parts_and_a_missing_part_is_detected(redis_server, monkeypatch):
    import tierkv.tiers.remote as remote
    monkeypatch.setattr(remote, "FILE_PART", 1000)
    store = RemoteStore(redis_server.url, "ns")
    payload = bytes(range(256)) * 10
    assert store.put_file("idx-2560-ab.safetensors", payload)
    assert store.file_names("idx-") == ["idx-2560-ab.safetensors"]
    assert store.get_file("idx-2560-ab.safetensors") == payload
    redis_server.client().delete(b"tierkv:ns:f:idx-2560-ab.safetensors:1")
    assert store.get_file("idx-2560-ab.safetensors") is None
    assert store.file_names() == [] and store.stats.corrupt == 1
    assert FILE_PART == 64 * 1024**2


def _manager(url: str, **kw) -> BlockingTierManager:
    return BlockingTierManager.from_config(TierConfig(block_bytes=BLOCK, cpu=64 * BLOCK, remote=url, **kw),
                                           namespace="test")


def test_a_second_manager_finds_the_first_ones_blocks(redis_server, tmp_path):
    keys = [BlockKey.of("blk", i) for i in range(8)]
    with _manager(redis_server.url) as first:
        for i, key in enumerate(keys):
            first.put(key, block(i), persist=True)
        first.flush()
        assert first.manager.remote.stats.written == 8
    with _manager(redis_server.url, nvme_dir=tmp_path / "store") as second:
        assert second.protect(keys)
        lease = second.acquire(keys)
        try:
            for i, view in enumerate(lease.views):
                assert torch.equal(view, block(i))
        finally:
            lease.release()
        second.flush()
        assert second.where(keys[0]) == ["cpu", "nvme"]        # persisted locally too
        assert second.manager.remote.stats.written == 0          # and not written back


def test_protect_is_all_or_nothing_across_local_and_remote(redis_server):
    stored, absent = BlockKey.of("stored"), BlockKey.of("absent")
    with _manager(redis_server.url) as first:
        first.put(stored, block(1), persist=True)
        first.flush()
    with _manager(redis_server.url) as second:
        assert not second.protect([stored, absent])
        entry = second.manager.directory.get(stored)
        assert entry is not None and entry.holders == 0       # fetched, then let go with the rest
        assert second.hold([absent]) == [absent]


def test_blocks_are_not_read_where_recomputing_is_faster(redis_server):
    key = BlockKey.of("k")
    with _manager(redis_server.url) as first:
        first.put(key, block(3), persist=True)
        first.flush()
    with _manager(redis_server.url) as second:
        second.manager.recompute = Recompute(seconds_per_block=1e-9)
        assert not second.protect([key])
        assert second.manager.remote.stats.slower == 1
        second.manager.recompute = Recompute(seconds_per_block=1.0)
        assert second.protect([key])


def test_a_dead_remote_never_blocks_puts_or_reads(redis_server):
    keys = [BlockKey.of("k", i) for i in range(4)]
    with _manager(redis_server.url) as manager:
        redis_server.kill()
        for i, key in enumerate(keys):
            manager.put(key, block(i), persist=True)
        manager.flush()
        assert manager.protect(keys)                     # local copies serve
        assert manager.hold([BlockKey.of("never")]) == [BlockKey.of("never")]
        assert manager.manager.remote.stats.written == 0


def test_a_slow_remote_costs_one_timeout_and_is_reported_once(redis_server, caplog):
    store = RemoteStore(redis_server.url, "ns", timeout_s=0.3, retry_s=60)
    key = BlockKey.of("k")
    store.put_many([(key, b"s" * BLOCK)])
    redis_server.client().execute_command("CLIENT", "PAUSE", 3000)     # the server answers nobody for 3 s
    began = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers.remote"):
        for _ in range(5):
            assert store.get_many([key], BLOCK) == [None]
    assert time.perf_counter() - began < 2.0
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    assert "Timeout" in store.stats.last_error or "timed out" in store.stats.last_error
