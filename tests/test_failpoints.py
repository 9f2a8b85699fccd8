"""Failpoints: what ``TIERKV_FAILPOINTS`` arms, and a keyed point killing its process at every visit with its key."""
from __future__ import annotations

import os
import signal

import pytest

from tierkv import failpoints
from tierkv.errors import ConfigError


def test_counts_and_keys_parse_and_bad_items_say_what_is_allowed():
    assert failpoints.parse("batch.worker-call:2, batch.worker-document@c.txt") == {
        "batch.worker-call": 2, "batch.worker-document@c.txt": 1}
    for bad in ("nope:1", "batch.worker-call:0", "nope@k", "batch.worker-document@"):
        with pytest.raises(ConfigError, match="TIERKV_FAILPOINTS"):
            failpoints.parse(bad)


def test_a_keyed_point_kills_at_every_visit_with_its_key_and_never_with_another():
    pid = os.fork()
    if pid == 0:                                    # the child: survives other keys, dies at its own
        try:
            failpoints.arm("batch.worker-document@c.txt")
            for key in ("a.txt", "b.txt", "a.txt"):
                failpoints.failpoint("batch.worker-document", key)
            failpoints.failpoint("batch.worker-document", "c.txt")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
