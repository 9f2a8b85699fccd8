"""The cxl tier and its link model: what a transfer costs, queueing, devices, bad input."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tierkv.config import TierConfig
from tierkv.errors import ConfigError
from tierkv.events import EventRecorder
from tierkv.tiers.cxl import CxlTier, cxl_tier
from tierkv.tiers.cxl_link import LINK_PRESETS, CxlLink, Direction, LinkSpec, link_spec

MiB = 1024**2
BB = 1 * MiB
# A slow link, so that a transfer of a few MiB lasts long next to timer and scheduler noise.
SLOW = LinkSpec(read_gbps=0.1, write_gbps=0.2, latency_ns=2e6)   # 2 ms load-to-use latency
pytestmark = pytest.mark.serial                                    # its links time real waits
SLACK_S = 0.1                                                       # a loaded 2-core machine (load 3-6)


def modelled(nbytes: int, gbps: float, latency_ns: float) -> float:
    return nbytes / (gbps * 1e9) + latency_ns * 1e-9


def filled(tier: CxlTier, slots: int) -> None:
    for s in range(slots):
        tier.view(s).fill_(s % 251)


def timed_gather(tier: CxlTier, slots: list[int]) -> float:
    out = torch.empty(len(slots) * tier.block_bytes, dtype=torch.uint8)
    start = time.perf_counter()
    tier.gather(slots, out)
    elapsed = time.perf_counter() - start
    assert torch.equal(out.view(len(slots), -1)[:, 0], torch.tensor([s % 251 for s in slots], dtype=torch.uint8))
    return elapsed


def test_an_idle_link_charges_bytes_over_bandwidth_plus_latency() -> None:
    tier = CxlTier(BB, 32 * BB, SLOW)
    filled(tier, 32)
    for n in (8, 32):          # 86 ms and 338 ms of modelled read time
        expected = modelled(n * BB, SLOW.read_gbps, SLOW.latency_ns)
        elapsed = timed_gather(tier, list(range(n)))
        assert expected <= elapsed <= expected * 1.1 + SLACK_S, (n, expected, elapsed)
    src = torch.zeros(16 * BB, dtype=torch.uint8)
    start = time.perf_counter()
    tier.scatter(list(range(16)), src)  # writes have their own bandwidth
    elapsed = time.perf_counter() - start
    expected = modelled(16 * BB, SLOW.write_gbps, SLOW.latency_ns)
    assert expected <= elapsed <= expected * 1.1 + SLACK_S
    assert tier.link.stats.nbytes == {Direction.READ: 40 * BB, Direction.WRITE: 16 * BB}


def test_a_ticket_is_exactly_the_model() -> None:
    link = CxlLink(LinkSpec(10.0, 5.0, 300.0))
    ticket = link.book_bytes(Direction.WRITE, 5_000_000)
    assert ticket.queue_s == 0.0
    # timestamps are perf_counter seconds (~1e4): their difference is exact to ~1e-12 s, not 1e-9 relative
    assert ticket.done - ticket.begin == pytest.approx(5e6 / 5e9 + 300e-9, abs=1e-10)


def test_concurrent_requests_on_one_device_queue() -> None:
    tier = CxlTier(BB, 32 * BB, SLOW)
    filled(tier, 32)
    one = modelled(12 * BB, SLOW.read_gbps, SLOW.latency_ns)   # 128 ms each
    times = run_together(lambda: timed_gather(tier, list(range(12))),
                         lambda: timed_gather(tier, list(range(12, 24))))
    latency = SLOW.latency_ns * 1e-9
    assert max(times) >= 2 * one - latency - 1e-3  # the second streamed after the first
    assert max(times) <= 2 * one * 1.1 + SLACK_S
    assert tier.link.stats.queue_s > 0


def test_a_request_booked_while_another_streams_waits_for_it() -> None:
    link = CxlLink(SLOW)
    first = link.book_bytes(Direction.READ, 4 * BB)
    second = link.book_bytes(Direction.READ, 2 * BB)
    stream = 4 * BB / (SLOW.read_gbps * 1e9)
    assert second.begin == pytest.approx(first.begin + stream, abs=1e-3)   # booked at once: it queues
    assert second.queue_s == pytest.approx(stream, abs=1e-3)
    assert second.done - second.begin == pytest.approx(modelled(2 * BB, SLOW.read_gbps, SLOW.latency_ns))
    other = link.book_bytes(Direction.WRITE, 2 * BB)                      # the other direction is free
    assert other.queue_s == pytest.approx(0.0, abs=1e-3)


def test_requests_on_different_devices_or_directions_do_not_queue() -> None:
    spec = LinkSpec(SLOW.read_gbps, SLOW.read_gbps, SLOW.latency_ns, devices=2)
    tier = CxlTier(BB, 48 * BB, spec)
    filled(tier, 48)
    one = modelled(12 * BB, spec.read_gbps, spec.latency_ns)
    even, odd = list(range(0, 24, 2)), list(range(1, 24, 2))   # device 0 and device 1
    times = run_together(lambda: timed_gather(tier, even), lambda: timed_gather(tier, odd))
    assert max(times) <= one * 1.1 + SLACK_S
    src = torch.zeros(12 * BB, dtype=torch.uint8)
    later = list(range(24, 48, 2))                              # device 0 too, other slots
    times = run_together(lambda: timed_gather(tier, even), lambda: tier.scatter(later, src))
    assert max(times) <= one * 1.1 + SLACK_S


def test_several_devices_share_one_transfer() -> None:
    spec = LinkSpec(SLOW.read_gbps, SLOW.read_gbps, SLOW.latency_ns, devices=4)
    tier = CxlTier(BB, 32 * BB, spec)
    filled(tier, 32)
    expected = modelled(8 * BB, spec.read_gbps, spec.latency_ns)   # 32 blocks, 8 per device: 86 ms, not 338
    elapsed = timed_gather(tier, list(range(32)))
    assert expected <= elapsed <= expected * 1.1 + SLACK_S


def test_link_records_queue_and_link_slices() -> None:
    recorder = EventRecorder()
    link = CxlLink(LinkSpec(1.0, 1.0, 1e5), recorder)
    first = link.book_bytes(Direction.READ, 30_000_000, src="cxl", dst="gpu", layer=3)   # streams 30 ms
    second = link.book_bytes(Direction.READ, 1_000_000, src="cxl", dst="gpu", layer=3)
    link.wait(first)
    link.wait(second)
    kinds = [(e.kind, e.nbytes) for e in recorder.events]
    assert kinds == [("link", 30_000_000), ("queue", 1_000_000), ("link", 1_000_000)]
    queue = recorder.events[1]
    assert queue.done - queue.start == pytest.approx(second.queue_s) and second.queue_s > 1e-3


def test_tier_budget_is_slots() -> None:
    tier = cxl_tier(BB, 5 * BB + 100, "cxl2-x16")
    assert tier.pool.capacity == 5 and tier.budget_bytes == 5 * BB
    assert tier.link.spec == LINK_PRESETS["cxl2-x16"]
    assert not tier.reads_in_place


def test_bad_input_names_field_value_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="cxl_preset='pcie9'.*cxl2-x8, cxl2-x16"):
        link_spec("pcie9")
    with pytest.raises(ConfigError, match="read_gbps=0.*> 0"):
        LinkSpec(0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="latency_ns=-1.*>= 0"):
        LinkSpec(1.0, 1.0, -1)
    with pytest.raises(ConfigError, match="devices=0.*>= 1"):
        link_spec("cxl2-x8", devices=0)
    with pytest.raises(ConfigError, match="cxl_preset='x'"):
        TierConfig(cxl="64MiB", cxl_preset="x")
    with pytest.raises(ConfigError, match="cxl=100: a non-zero budget must hold at least one block"):
        TierConfig(cxl=100)
    assert TierConfig(cxl="1GiB", cxl_preset="cxl2-x8", cxl_read_gbps=20.0).cxl_link().read_gbps == 20.0
    assert TierConfig().cxl == 0  # no pool unless asked for


def run_together(*calls) -> list[float]:
    """Run ``calls`` on threads released at once; when each ended, in seconds after the first began."""
    starts, ends = [0.0] * len(calls), [0.0] * len(calls)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        starts[i] = time.perf_counter()
        try:
            calls[i]()
        except BaseException as error:  # noqa: BLE001  re-raised on the test's thread
            errors.append(error)
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [end - min(starts) for end in ends]
