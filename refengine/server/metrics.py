"""Prometheus metrics on ``/metrics``, named as vLLM's with ``pagedbench:`` in place of ``vllm:``, so a
vLLM dashboard needs only its prefix changed.

Engine state, read from an :class:`~pagedbench.refengine.engine.async_llm.EngineSnapshot` at each
scrape (taken between two steps by the engine thread):

=========================================  =========  ==================================================
``pagedbench:num_requests_running``        gauge      requests with sequences in the running batch
``pagedbench:num_requests_waiting``        gauge      requests queued (new or preempted), not running
``pagedbench:kv_cache_usage_perc``         gauge      used KV blocks / pool blocks (0-1)
``pagedbench:kv_cache_used_blocks``        gauge      used KV blocks (ours; vLLM gives the fraction only)
``pagedbench:prefix_cache_queries_total``  counter    prompt tokens looked up in the prefix cache
``pagedbench:prefix_cache_hits_total``     counter    of those, tokens served from it (hit rate = ratio)
``pagedbench:prefix_cache_host_hits_total``  counter  of those, tokens loaded from its host tier (ours;
                                                      never in ``prefix_cache_hits``)
``pagedbench:prefix_cache_computed_total``   counter  of those, tokens neither tier served (ours)
``pagedbench:num_preemptions_total``       counter    sequences preempted (recompute)
``pagedbench:prompt_tokens_total``         counter    prompt tokens of accepted requests
``pagedbench:generation_tokens_total``     counter    tokens sampled
``pagedbench:engine_step_seconds``         summary    wall time of each engine step (ours)
``pagedbench:cache_config_info``           info       num_gpu_blocks (pool blocks), block_size
=========================================  =========  ==================================================

Per request, on engine times (the request's arrival at the engine, the end of the step that produced
each token), observed when the request ends: ``time_to_first_token_seconds``,
``inter_token_latency_seconds`` (every gap), ``request_time_per_output_token_seconds`` (TPOT without
the first token), ``e2e_request_latency_seconds`` (histograms) and ``request_success_total`` by
``finished_reason`` (stop, length, abort). Every series carries ``model_name``.
"""

from __future__ import annotations

import itertools

from pagedbench.refengine.engine.async_llm import EngineSnapshot
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily

PREFIX = "pagedbench:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Exports the last snapshot handed to :meth:`ServerMetrics.render`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        labels, value = ["model_name"], [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Number of requests in the running batch.", s.num_running_requests)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting_requests)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.num_used_blocks / s.num_blocks)
        yield gauge("kv_cache_used_blocks", "KV-cache blocks held by sequences.", s.num_used_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        yield counter("prefix_cache_host_hits", "Prompt tokens loaded from the prefix cache's host tier.",
                      s.prefix_host_hit_tokens)
        yield counter("prefix_cache_computed", "Prompt tokens looked up that neither cache tier served.",
                      s.prefix_computed_tokens)
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens of accepted requests.", s.num_prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", s.num_generated_tokens)
        step = SummaryMetricFamily(PREFIX + "engine_step_seconds", "Wall time of engine steps.", labels=labels)
        step.add_metric(value, s.num_steps, s.step_time_s)
        yield step
        info = InfoMetricFamily(PREFIX + "cache_config", "Information of the KV cache.")
        info.add_metric([], {"num_gpu_blocks": str(s.num_blocks), "block_size": str(s.block_size)})
        yield info


class ServerMetrics:
    """The server's registry (one per app, so several apps in one process do not collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Histogram of time per output token (the first excluded) per request, in seconds.",
                              labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Histogram of end-to-end request latency.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Count of finished requests by finish reason.",
                                [*labels, "finished_reason"], registry=r)

    def observe_request(self, arrival_s: float, token_times_s: list[float], num_output_tokens: int,
                        finished_reason: str) -> None:
        """One ended request: its arrival, the times its tokens came out (one per step that produced
        any), the tokens it generated, and its API finish reason."""
        self._success.labels(self.model_name, finished_reason).inc()
        if not token_times_s:
            return
        self.ttft.observe(token_times_s[0] - arrival_s)
        for a, b in itertools.pairwise(token_times_s):
            self.itl.observe(b - a)
        if num_output_tokens > 1:
            self.tpot.observe((token_times_s[-1] - token_times_s[0]) / (num_output_tokens - 1))
        self.e2e.observe(token_times_s[-1] - arrival_s)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)
