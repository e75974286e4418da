"""Prometheus metrics for the server, fed by the engine's observer hooks and the HTTP layer.

Each server has its own registry (two servers in one process, as in the tests, do not share
counters). ``GET /metrics`` renders it in the text exposition format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from turbospark_jax.server.requests import EngineObserver

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics(EngineObserver):
    """The server's counters, histograms and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = Counter("turbospark_http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("turbospark_prompt_tokens", "prompt tokens received",
                                     registry=r)
        self.cached_tokens = Counter("turbospark_cached_prompt_tokens",
                                     "prompt tokens reused from a slot's state", registry=r)
        self.shared_tokens = Counter("turbospark_shared_prompt_tokens",
                                     "prompt tokens reused from another slot's state (among the "
                                     "cached prompt tokens)", registry=r)
        self.shared_requests = Counter("turbospark_shared_prefix_requests",
                                       "requests that started from another slot's state",
                                       registry=r)
        self.generated = Counter("turbospark_generated_tokens", "tokens generated", registry=r)
        self.evictions = Counter("turbospark_slot_evictions",
                                 "requests that discarded another session's state", registry=r)
        self.outcomes = Counter("turbospark_requests_finished", "requests ended, by outcome",
                                ["outcome"], registry=r)
        self.choices_asked = Counter("turbospark_parallel_choices",
                                     "choices asked for by requests with n > 1", registry=r)
        self.ttft = Histogram("turbospark_time_to_first_token_seconds",
                              "submission to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("turbospark_inter_token_seconds", "time between a request's tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_rows = Histogram("turbospark_decode_batch_rows", "rows per batched decode step",
                                   buckets=_ROW_BUCKETS, registry=r)
        self.prefilled = Counter("turbospark_prefilled_prompt_tokens",
                                 "prompt tokens fed by prefill calls (the prompt tokens not "
                                 "reused from a slot's state)", registry=r)
        self.prefill_rows = Histogram("turbospark_prefill_batch_rows",
                                      "requests per prefill call", buckets=_ROW_BUCKETS,
                                      registry=r)
        self.busy = Gauge("turbospark_busy_slots", "slots serving a request", registry=r)
        self.waiting = Gauge("turbospark_waiting_requests", "requests waiting for a slot",
                             registry=r)
        self.slots = Gauge("turbospark_slots", "session slots (the decode batch)", registry=r)

    def request_started(self, prompt_tokens: int, cached_tokens: int, evicted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        if evicted:
            self.evictions.inc()

    def prefix_shared(self, tokens: int) -> None:
        self.shared_tokens.inc(tokens)
        self.shared_requests.inc()

    def choices(self, n: int) -> None:
        self.choices_asked.inc(n)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def request_ended(self, outcome: str, generated: int) -> None:
        self.outcomes.labels(outcome=outcome).inc()
        self.generated.inc(generated)

    def step(self, rows: int, seconds: float) -> None:
        self.step_rows.observe(rows)

    def prefill(self, rows: int, tokens: int) -> None:
        self.prefill_rows.observe(rows)
        self.prefilled.inc(tokens)

    def render(self, load: dict[str, int]) -> bytes:
        """The exposition text, with the gauges set from the engine's ``load()``."""
        self.busy.set(load["busy_slots"])
        self.waiting.set(load["waiting"])
        self.slots.set(load["slots"])
        return generate_latest(self.registry)
