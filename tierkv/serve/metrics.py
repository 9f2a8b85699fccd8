"""What ``tierkv serve`` exports at ``/metrics`` (Prometheus text format), in one registry per server.

    tierkv_requests_total{endpoint, status}           requests answered, by HTTP status
    tierkv_request_seconds{endpoint}                   from arrival to the last byte (histogram)
    tierkv_ttft_seconds                                from the start of the work to the first token
    tierkv_queue_depth                                 requests waiting for the worker
    tierkv_requests_running                            requests answered now (up to --parallel)
    tierkv_prompt_tokens_total                         prompt tokens of answered requests
    tierkv_prefix_cache_hit_tokens_total               of those, served from stored KV (not computed)
    tierkv_generated_tokens_total
    tierkv_cancelled_total                             answers stopped because the client left
    tierkv_stall_seconds_total                         decode time spent waiting on tier loads
    tierkv_tier_bytes{mode, tier}                      bytes held per tier, per mode (dense, sparse)
    tierkv_tier_budget_bytes{mode, tier}
    tierkv_pinned_blocks                               blocks pinned right now (0 when idle)
    tierkv_remote_blocks{mode, what}                   with --remote, blocks since the start: hits, misses,
                                                       corrupt, written, skipped, slower (not read), errors
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tierkv.session import Answer, Session

REMOTE_COUNTS = ("hits", "misses", "corrupt", "written", "skipped", "slower", "errors")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tierkv_requests", "requests answered", ["endpoint", "status"], registry=r)
        self.latency = Histogram("tierkv_request_seconds", "request latency", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tierkv_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.queued = Gauge("tierkv_queue_depth", "requests waiting", registry=r)
        self.running = Gauge("tierkv_requests_running", "requests answered now", registry=r)
        self.prompt_tokens = Counter("tierkv_prompt_tokens", "prompt tokens", registry=r)
        self.hit_tokens = Counter("tierkv_prefix_cache_hit_tokens", "prompt tokens served from stored KV",
                                  registry=r)
        self.generated = Counter("tierkv_generated_tokens", "tokens generated", registry=r)
        self.cancelled = Counter("tierkv_cancelled", "answers stopped because the client left", registry=r)
        self.stall = Counter("tierkv_stall_seconds", "decode seconds waiting on tier loads", registry=r)
        self.tier_bytes = Gauge("tierkv_tier_bytes", "bytes held per tier", ["mode", "tier"], registry=r)
        self.tier_budget = Gauge("tierkv_tier_budget_bytes", "budget per tier", ["mode", "tier"], registry=r)
        self.pinned = Gauge("tierkv_pinned_blocks", "blocks pinned now", registry=r)
        self.remote = Gauge("tierkv_remote_blocks", "remote store blocks since the start, by what befell them",
                            ["mode", "what"], registry=r)

    def answered(self, answer: Answer, seconds: float, session: Session) -> None:
        """One answer done (finished or cancelled), on the worker thread."""
        self.ttft.observe(answer.ttft_s)
        self.prompt_tokens.inc(answer.prompt_tokens)
        self.hit_tokens.inc(answer.reused_tokens)
        self.generated.inc(answer.generated_tokens)
        self.stall.inc(answer.stall_s)
        self.refresh(session)

    def refresh(self, session: Session) -> None:
        pinned = 0
        for mode, backend in list(session.backends.items()):    # (the worker may open one meanwhile)
            for tier, row in backend.tier_report().items():
                self.tier_bytes.labels(mode, tier).set(row["final_bytes"])
                self.tier_budget.labels(mode, tier).set(row["budget_bytes"])
            pinned += backend.pinned_blocks()
            for what, count in (backend.remote_report() or {}).items():
                if what in REMOTE_COUNTS:
                    self.remote.labels(mode, what).set(count)
        self.pinned.set(pinned)

    def text(self) -> bytes:
        return generate_latest(self.registry)
