"""Prometheus metrics with vLLM's names and its ``vllm:`` prefix, so dashboards, alerts
and benchmark tools written for a vLLM server read a cpullm server unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cpullm.engine.async_engine import AsyncEngine
from cpullm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _EngineCollector(Collector):
    """Scheduler gauges, read from the engine's latest stats at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        stats = self.engine.stats
        labels = ["model_name"]
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in model execution batches.",
                 stats.num_running),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                 stats.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.",
                 stats.kv_cache_usage),
                ("cpullm:kv_cache_free_blocks", "KV cache blocks not held by any request.",
                 stats.num_free_blocks),
                ("cpullm:kv_cache_total_blocks", "KV cache blocks in all.", stats.num_blocks),
                ("cpullm:engine_dead", "1 once the engine loop has stopped on an error.",
                 int(self.engine.errored))):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, doc, value in (
                ("vllm:num_preemptions", "Preemptions of running requests.",
                 stats.num_preemptions),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 stats.prefix_cache_hits)):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self.model_name], value)
            yield counter


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS):
            return Histogram(name, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(**labels)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time to first token in seconds.")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between streamed tokens in seconds.")
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds",
                                     "End-to-end request latency in seconds.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.",
                                     ["model_name"], registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.",
                                         ["model_name"], registry=self.registry).labels(**labels)
        self._success = Counter("vllm:request_success", "Successfully finished requests.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def record_finished(self, output: RequestOutput, num_prompt_tokens: int,
                        num_generated: int, e2e_seconds: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        self.e2e_latency.observe(e2e_seconds)
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self._success.labels(self.model_name, completion.finish_reason).inc()
