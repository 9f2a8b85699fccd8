"""Block keys: content addresses that hash, compare and sort as their 16 bytes."""
from __future__ import annotations

import pickle

import pytest

from tierkv.keys import BlockKey, layer_keys, prefix_keys, root_key


def test_a_key_is_its_digest_for_hashing_comparison_and_order() -> None:
    a, b = BlockKey.of("page", 1), BlockKey.of("page", 2)
    again = BlockKey(a.digest)                    # another object, the same content
    assert again == a and hash(again) == hash(a) and again in {a: 1}
    assert a != b and sorted([a, b]) == sorted([a, b], key=lambda k: k.digest)
    assert type(a.digest) is bytes and len(a.digest) == 16 and a.hex() == a.digest.hex()
    assert repr(a) == str(a) == f"BlockKey({a.hex()[:12]})"
    assert pickle.loads(pickle.dumps(a)) == a and type(pickle.loads(pickle.dumps(a))) is BlockKey


def test_a_digest_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="digest: 15 bytes, expected 16"):
        BlockKey(b"\x00" * 15)


def test_prefix_keys_chain_full_blocks_only() -> None:
    root = root_key("m", "layout", "bf16")
    keys = prefix_keys(root, list(range(10)), 4)            # two full blocks, a partial tail
    assert len(keys) == 2 and keys[0] == prefix_keys(root, list(range(4)), 4)[0]
    assert keys[1] != prefix_keys(root, [0, 1, 2, 3, 9, 9, 9, 9], 4)[1]   # a key names its whole prefix
    assert len(set(layer_keys(keys[0], range(3)))) == 3


def test_a_series_of_keys_is_the_keys_one_by_one():
    root = BlockKey.of("series")
    assert BlockKey.series(root, "page", 7, first=3, count=50) == [BlockKey.of(root, "page", 7, i) for i in range(3, 53)]
    assert BlockKey.series(root, count=0) == []
