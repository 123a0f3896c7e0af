"""Prometheus metrics with vLLM's names, labels (``model_name``, ``engine``) and buckets, so
dashboards, alerts and benchmark tools written for a vLLM server read a cpullm server
unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cpullm.engine.async_engine import ServingEngine
from cpullm.outputs import RequestOutput
from cpullm.sampling_params import SamplingParams

_LABELS = ["model_name", "engine"]
API_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
_ENGINE = "0"  # the label of what no replica owns (refusals, the server's configuration)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    buckets = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector(Collector):
    """Scheduler gauges and counters, one sample per engine-core replica (label ``engine``,
    as vLLM numbers its data-parallel engines), read from the latest stats at scrape time."""

    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        replicas = list(enumerate(self.engine.replica_stats))
        dead = int(self.engine.errored)
        gauges = (
            ("vllm:num_requests_running", "Requests in model execution batches.",
             lambda s: s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
             lambda s: s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.",
             lambda s: s.kv_cache_usage),
            ("cpullm:kv_cache_free_blocks", "KV cache blocks not held by any request.",
             lambda s: s.num_free_blocks),
            ("cpullm:kv_cache_total_blocks", "KV cache blocks in all.", lambda s: s.num_blocks),
            ("cpullm:engine_dead", "1 once the engine has stopped on an error.",
             lambda s: dead))
        counters = (
            ("vllm:num_preemptions", "Preemptions of running requests.",
             lambda s: s.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             lambda s: s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             lambda s: s.prefix_cache_hits))
        if self.engine.config.scheduler.speculative is not None:
            counters += (
                ("vllm:spec_decode_num_drafts", "Steps that verified proposed tokens.",
                 lambda s: s.spec_num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.",
                 lambda s: s.spec_num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                 lambda s: s.spec_num_accepted_tokens))
        for family, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in metrics:
                metric = family(name, doc, labels=_LABELS)
                for replica, stats in replicas:
                    metric.add_metric([self.model_name, str(replica)], value(stats))
                yield metric
        speculative = self.engine.config.scheduler.speculative
        if speculative is not None:
            metric = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Proposed tokens accepted, by their place in the proposal.",
                labels=[*_LABELS, "position"])
            for replica, stats in replicas:
                accepted = stats.spec_accepted_per_position
                for position in range(speculative.num_speculative_tokens):
                    metric.add_metric([self.model_name, str(replica), str(position)],
                                      accepted[position] if position < len(accepted) else 0)
            yield metric


class RequestMetrics:
    """The request-level metrics of one engine replica (its ``engine`` label)."""

    def __init__(self, families: dict[str, Any], success: Counter, model_name: str,
                 engine: str) -> None:
        child = {name: family.labels(model_name, engine) for name, family in families.items()}
        self.time_to_first_token = child["time_to_first_token"]
        self.inter_token_latency = child["inter_token_latency"]
        self._child = child
        self._success, self._labels = success, (model_name, engine)

    def record_pooled(self, num_prompt_tokens: int, e2e_seconds: float) -> None:
        """A pooling request's input, read and pooled."""
        child = self._child
        child["prompt_tokens"].inc(num_prompt_tokens)
        child["e2e_latency"].observe(e2e_seconds)
        child["request_prompt_tokens"].observe(num_prompt_tokens)
        self._success.labels(*self._labels, "stop").inc()

    def record_aborted(self) -> None:
        """A request its client left (or stopped) before it finished: vLLM's "abort"."""
        self._success.labels(*self._labels, "abort").inc()

    def record_finished(self, output: RequestOutput, params: SamplingParams,
                        num_prompt_tokens: int, num_generated: int, e2e_seconds: float) -> None:
        child = self._child
        child["prompt_tokens"].inc(num_prompt_tokens)
        child["generation_tokens"].inc(num_generated)
        child["e2e_latency"].observe(e2e_seconds)
        child["request_prompt_tokens"].observe(num_prompt_tokens)
        child["request_generation_tokens"].observe(num_generated)
        child["request_params_n"].observe(params.n)
        if params.max_tokens is not None:
            child["request_params_max_tokens"].observe(params.max_tokens)
        times = output.metrics
        for name, start, end in (("queue_time", "arrival_time", "scheduled_time"),
                                 ("prefill_time", "scheduled_time", "first_token_time"),
                                 ("decode_time", "first_token_time", "last_token_time"),
                                 ("inference_time", "scheduled_time", "last_token_time")):
            if start in times and end in times:
                child[name].observe(times[end] - times[start])
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self._success.labels(*self._labels, completion.finish_reason).inc()


class ServerMetrics:
    """The server's metric families. Request-level ones are recorded as requests finish,
    under the replica that ran them (``for_engine``); the tokens of each engine step on
    the engine thread."""

    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        config = engine.config
        max_model_len = config.model.max_model_len
        token_buckets = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=self.registry, buckets=buckets)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry)

        families: dict[str, Any] = {
            "time_to_first_token": histogram("vllm:time_to_first_token_seconds",
                                             "Time to first token in seconds.", _TTFT_BUCKETS),
            "inter_token_latency": histogram("vllm:inter_token_latency_seconds",
                                             "Time between streamed tokens in seconds.",
                                             _TOKEN_LATENCY_BUCKETS),
            "e2e_latency": histogram("vllm:e2e_request_latency_seconds",
                                     "End-to-end request latency in seconds.",
                                     _REQUEST_LATENCY_BUCKETS),
            "queue_time": histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled.",
                                    _REQUEST_LATENCY_BUCKETS),
            "prefill_time": histogram("vllm:request_prefill_time_seconds",
                                      "Time from first scheduled to the first token.",
                                      _REQUEST_LATENCY_BUCKETS),
            "decode_time": histogram("vllm:request_decode_time_seconds",
                                     "Time from the first token to the last.",
                                     _REQUEST_LATENCY_BUCKETS),
            "inference_time": histogram("vllm:request_inference_time_seconds",
                                        "Time from first scheduled to the last token.",
                                        _REQUEST_LATENCY_BUCKETS),
            "request_prompt_tokens": histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens of each finished request.",
                                               token_buckets),
            "request_generation_tokens": histogram(
                "vllm:request_generation_tokens", "Generated tokens of each finished request.",
                token_buckets),
            "request_params_n": histogram("vllm:request_params_n", "The n request parameter.",
                                          _N_BUCKETS),
            "request_params_max_tokens": histogram("vllm:request_params_max_tokens",
                                                   "The max_tokens request parameter.",
                                                   token_buckets),
            "prompt_tokens": counter("vllm:prompt_tokens", "Prefill tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens",
                                         "Generation tokens produced."),
        }
        success = Counter("vllm:request_success", "Successfully finished requests.",
                          [*_LABELS, "finished_reason"], registry=self.registry)
        # every replica's series exist from the start, so /metrics lists them all
        self._engines = [RequestMetrics(families, success, model_name, str(i))
                         for i in range(config.parallel.data_parallel_size)]
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Tokens computed by each engine step.",
                                          _ITERATION_TOKEN_BUCKETS).labels(model_name, _ENGINE)
        self.rejected_overload = counter(
            "cpullm:requests_rejected_overload",
            "Requests refused with a 503 because the server was at capacity.").labels(
                model_name, _ENGINE)
        cache = config.cache
        # vLLM names the KV blocks of its device "gpu blocks", on CPUs too.
        info = {"block_size": cache.block_size, "num_gpu_blocks": cache.num_blocks,
                "cache_dtype": config.model.kv_cache_dtype_name,
                "enable_prefix_caching": cache.enable_prefix_caching, "engine": _ENGINE}
        Gauge("vllm:cache_config_info", "Information of the engine's KV cache configuration.",
              list(info), registry=self.registry).labels(
                  **{k: str(v) for k, v in info.items()}).set(1)
        engine.on_step = self.iteration_tokens.observe
        self._api_requests = Counter("cpullm:api_requests", "Requests taken by each API route.",
                                     ["model_name", "route"], registry=self.registry)
        for route in API_ROUTES:  # listed from the start
            self._api_requests.labels(model_name, route)
        self.beam_searches = counter(
            "cpullm:beam_search_requests",
            "Prompts searched with use_beam_search (each beam step is not a request of its "
            "own).").labels(model_name, _ENGINE)

    def api_requests(self, route: str) -> None:
        """Count a request that ``route`` took."""
        self._api_requests.labels(self.model_name, route).inc()

    def track_responses_store(self, store: Any) -> None:
        """Report how many /v1/responses responses ``store`` (a sized container) keeps."""
        Gauge("cpullm:responses_stored", "Responses kept for previous_response_id and GET.",
              ["model_name"], registry=self.registry).labels(self.model_name).set_function(
                  lambda: len(store))

    def for_engine(self, replica: int) -> RequestMetrics:
        """The request-level metrics of engine replica ``replica``."""
        return self._engines[replica]
