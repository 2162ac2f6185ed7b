"""GET /metrics: Prometheus text from prometheus-client, `xlaserve:` names, a `model_name` label.

Engine state (running and waiting requests, KV usage, prefix cache, preemptions,
compilations after warmup, restarts) is read from each engine when scraped. Token
counts and latencies are measured here, as outputs reach the HTTP layer. The process's own
figures (`process_resident_memory_bytes`, CPU seconds, open files) come from
prometheus-client's process collector.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.async_engine import Engines
from engine.outputs import RequestOutput

disable_created_metrics()  # no `_created` series: they double the output and nobody reads them

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)

# (name, help, EngineStats field, kind)
_ENGINE_METRICS = [
    ("num_requests_running", "Requests in the running batch.", "num_running", "gauge"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting", "gauge"),
    ("kv_cache_usage_perc", "Fraction of KV blocks held by sequences (1 = full).", "kv_usage",
     "gauge"),
    ("num_free_kv_blocks", "KV blocks no sequence holds (prefix-cached ones included).",
     "num_free_blocks", "gauge"),
    ("num_kv_blocks", "Usable KV blocks.", "num_usable_blocks", "gauge"),
    ("num_touched_kv_blocks", "KV blocks written at least once since the engine started (on "
     "the CPU the pool's memory becomes resident as they are).", "num_touched_blocks", "gauge"),
    ("kv_cache_bytes", "Bytes of the KV pool on the device (every page).", "kv_cache_bytes",
     "gauge"),
    ("weight_bytes", "Bytes of the weights on the device.", "weight_bytes", "gauge"),
    ("engine_alive", "1 while the engine serves, 0 while it reboots.", "alive", "gauge"),
    ("prefix_cache_queries", "Full KV blocks looked up in the prefix cache.",
     "prefix_cache_queries", "counter"),
    ("prefix_cache_hits", "Full KV blocks found in the prefix cache.", "prefix_cache_hits",
     "counter"),
    ("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
     "num_preemptions", "counter"),
    ("request_aborts", "Requests aborted before they finished (the client left).",
     "num_aborted", "counter"),
    ("compilations_after_warmup", "XLA compilations after warmup (should stay 0).",
     "compilations_after_warmup", "counter"),
    ("engine_restarts", "Times the engine thread died and was rebuilt.", "num_restarts",
     "counter"),
    ("spec_decode_num_drafts", "Speculative decoding: sequence-steps that brought drafts.",
     "spec_decode_num_drafts", "counter"),
    ("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.",
     "spec_decode_num_draft_tokens", "counter"),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens kept.",
     "spec_decode_num_accepted_tokens", "counter"),
]


class _EngineCollector:
    def __init__(self, engines: Engines):
        self.engines = engines

    def collect(self):
        stats = {name: self.engines[name].stats() for name in self.engines.names()}
        for name, help_, field, kind in _ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                f"xlaserve:{name}", help_, labels=["model_name"])
            for model, s in stats.items():
                family.add_metric([model], float(getattr(s, field)))
            yield family


class ServerMetrics:
    def __init__(self, engines: Engines):
        self.registry = CollectorRegistry()
        # The server process's own resident memory, CPU time and open files
        # (process_resident_memory_bytes, ...), as prometheus-client reports them on Linux.
        ProcessCollector(registry=self.registry)
        self.registry.register(_EngineCollector(engines))
        r, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter("xlaserve:prompt_tokens", "Prompt tokens of accepted "
                                     "requests.", label, registry=r)
        self.generation_tokens = Counter("xlaserve:generation_tokens", "Generated tokens.",
                                         label, registry=r)
        self.requests = Counter("xlaserve:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("xlaserve:time_to_first_token_seconds", "Request arrival to "
                              "first token.", label, buckets=_LATENCY, registry=r)
        self.itl = Histogram("xlaserve:inter_token_latency_seconds", "Time between tokens of "
                             "a request.", label, buckets=_LATENCY, registry=r)
        self.e2e = Histogram("xlaserve:e2e_request_latency_seconds", "Request arrival to last "
                             "token.", label, buckets=_LATENCY, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, model: str) -> RequestTracker:
        return RequestTracker(self, model)


class RequestTracker:
    """Latencies and token counts of one HTTP request (all its prompts and choices)."""

    def __init__(self, metrics: ServerMetrics, model: str):
        self.m = metrics
        self.model = model
        self.arrival = self.last = time.perf_counter()
        self.first = False

    def accepted(self, num_prompt_tokens: int) -> None:
        self.m.prompt_tokens.labels(self.model).inc(num_prompt_tokens)

    def embedded(self) -> None:
        """An embeddings request answered."""
        self.m.e2e.labels(self.model).observe(time.perf_counter() - self.arrival)
        self.m.requests.labels(self.model, "stop").inc()

    def output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        new = sum(len(c.token_ids) for c in out.outputs)  # (outputs are deltas)
        if new:
            self.m.generation_tokens.labels(self.model).inc(new)
            if not self.first:
                self.first = True
                self.m.ttft.labels(self.model).observe(now - self.arrival)
            else:
                self.m.itl.labels(self.model).observe(now - self.last)
            self.last = now
        if out.finished:
            self.m.e2e.labels(self.model).observe(now - self.arrival)
            for c in out.outputs:
                self.m.requests.labels(self.model, c.finish_reason or "abort").inc()
