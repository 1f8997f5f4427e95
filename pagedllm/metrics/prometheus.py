"""`PrometheusStatLogger`: vLLM's Prometheus metrics, with vLLM's names, types, label names and
buckets (`vllm:num_requests_running{model_name=...,engine=...}` ...), so vLLM's Grafana
dashboards and autoscalers read a pagedllm server unchanged.

Series vLLM has and pagedllm lacks the data for are left out rather than reported as zero:
sleep state, LoRA, multimodal and external (KV-connector) prefix caches, NaN-corrupted
requests, KV block residency. The old `pagedllm:*` names are gone (no deprecation period:
every dashboard, test and benchmark in the repository reads the `vllm:` names).

Each instance owns its `CollectorRegistry` (never the process-global one), so several engines
in one process (tests) do not collide. Every series carries the labels `model_name` (the first
served model name) and `engine` (the engine index: the data-parallel rank). `PrometheusMetrics`
is a front end's `/metrics`: one logger per engine, rendered as one exposition.

pagedllm's two additions to vLLM's series: `vllm:engine_dead{model_name,engine}` (a gauge, 1
once that data-parallel engine has died while the others serve on; vLLM stops the whole server
instead, so it has no such series) and `vllm:engine_stalled{model_name,engine}` (a gauge, 1
while that engine is stalled, engine/stall.py; set when `/metrics` or `/health` is read).

Several API server processes (`--api-server-count`) share the metrics through
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set by the process that
starts them): counters and histograms add up over the processes, each counting only its own
requests and the scheduler stats sent to it; gauges show the most recent value written by any
process (vLLM's `multiprocess_mode="mostrecent"`), as each engine's scheduler stats go to one
API server per step (and the gauges of the step that leaves the engine idle to all of them, so
they settle on the idle state whichever process wrote last).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pagedllm.config import CacheConfig
from pagedllm.engine import SchedulerStats
from pagedllm.metrics.stats import IterationStats
from pagedllm.spec_decode.metrics import SpecDecodingProm

# Bucket edges as vLLM uses them (seconds / tokens).
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
_TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]
_FINISH_REASONS = ("stop", "length", "abort")
# CacheConfig field -> vLLM's label name in vllm:cache_config_info.
_CACHE_INFO_LABELS = {"num_blocks": "num_gpu_blocks"}


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


def cache_config_info(cache_config: CacheConfig) -> dict[str, str]:
    """The `vllm:cache_config_info` labels: every cache setting, as a string."""
    return {
        _CACHE_INFO_LABELS.get(f.name, f.name): str(getattr(cache_config, f.name))
        for f in dataclasses.fields(cache_config)
    }


class PrometheusStatLogger:
    """Feeds Prometheus gauges, counters and histograms from the engine's stats.

    Contract: `record` may be called with either argument None; counters only grow; gauges
    show the latest `SchedulerStats`. `log()` is a no-op (Prometheus pulls).
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 2048,
        engine_index: int = 0,
        cache_config: CacheConfig | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, str(engine_index))
        self._values = values
        gauge, counter, histogram = self._factories(labels, values)

        self.running = gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(
            "num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {r: self._success.labels(*values, r) for r in _FINISH_REASONS}

        tokens = build_1_2_5_buckets(max_model_len)
        latency = _REQUEST_LATENCY_BUCKETS
        for attr, name, doc, buckets in (
            ("request_prompt_tokens", "request_prompt_tokens",
             "Number of prefill tokens processed.", tokens),
            ("request_generation_tokens", "request_generation_tokens",
             "Number of generation tokens processed.", tokens),
            ("iteration_tokens", "iteration_tokens_total",
             "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS),
            ("max_generation_tokens", "request_max_num_generation_tokens",
             "Histogram of maximum number of requested generation tokens.", tokens),
            ("params_n", "request_params_n", "Histogram of the n request parameter.",
             _N_BUCKETS),
            ("params_max_tokens", "request_params_max_tokens",
             "Histogram of the max_tokens request parameter.", tokens),
            ("ttft", "time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", _TTFT_BUCKETS),
            ("itl", "inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", _TOKEN_LATENCY_BUCKETS),
            ("tpot", "request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", _TOKEN_LATENCY_BUCKETS),
            ("e2e", "e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", latency),
            ("queue_time", "request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", latency),
            ("inference_time", "request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request.", latency),
            ("prefill_time", "request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", latency),
            ("decode_time", "request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.", latency),
        ):  # fmt: skip
            setattr(self, attr, histogram(name, doc, buckets))
        if cache_config is not None:
            info = {**cache_config_info(cache_config), "engine": str(engine_index)}
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(info),
                registry=self.registry,
                multiprocess_mode="mostrecent",
            ).labels(**info).set(1)
        # pagedllm's addition (module docstring): 1 once this data-parallel engine died.
        self.engine_dead = gauge("engine_dead", "1 if this data-parallel engine has died.")
        self.engine_dead.set(0)
        self.engine_stalled = gauge(
            "engine_stalled",
            "1 while this engine is stalled: requests wait or run and no step finished for "
            "longer than --stall-timeout-s.",
        )
        self.engine_stalled.set(0)
        self.spec_decoding = SpecDecodingProm(self.registry, labels, values)

    def _factories(
        self, labels: list[str], values: tuple[str, ...]
    ) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        reg = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(
                f"vllm:{name}", doc, labels, registry=reg, multiprocess_mode="mostrecent"
            ).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"vllm:{name}", doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            metric = Histogram(f"vllm:{name}", doc, labels, buckets=buckets, registry=reg)
            return metric.labels(*values)

        return gauge, counter, histogram

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            self.running.set(scheduler_stats.num_running_reqs)
            self.waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_usage.set(scheduler_stats.kv_cache_usage)
            self.preemptions.inc(scheduler_stats.num_preemptions)
            self.prefix_queries.inc(scheduler_stats.prefix_cache_queries)
            self.prefix_hits.inc(scheduler_stats.prefix_cache_hits)
            self.spec_decoding.observe(scheduler_stats.spec_decode)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_iteration(self, it: IterationStats) -> None:
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for ttft in it.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies:
            self.itl.observe(itl)
        for n in it.n_params:
            self.params_n.observe(n)
        for num_tokens in it.max_num_generation_tokens:
            self.max_generation_tokens.observe(num_tokens)
        for finished in it.finished_requests:
            reason = finished.finish_reason
            if reason not in self.request_success:
                self.request_success[reason] = self._success.labels(*self._values, reason)
            self.request_success[reason].inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queued_time)
            self.prefill_time.observe(finished.prefill_time)
            self.inference_time.observe(finished.inference_time)
            self.decode_time.observe(finished.decode_time)
            self.tpot.observe(finished.mean_time_per_output_token)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.max_tokens_param:
                self.params_max_tokens.observe(finished.max_tokens_param)

    def log(self) -> None:
        pass

    def render(self) -> bytes:
        """The Prometheus text exposition of this logger's registry."""
        return render_registries([self.registry])


class PrometheusMetrics:
    """A front end's metrics: one `PrometheusStatLogger` per engine, engine `r` described by
    `cache_configs[r]` (each data-parallel engine sizes its own KV cache)."""

    def __init__(
        self, model_name: str, cache_configs: Sequence[CacheConfig], max_model_len: int
    ) -> None:
        self.loggers = [
            PrometheusStatLogger(model_name, max_model_len, engine_index=r, cache_config=c)
            for r, c in enumerate(cache_configs)
        ]

    def for_engine(self, engine_index: int) -> PrometheusStatLogger:
        return self.loggers[engine_index]

    def render(self) -> bytes:
        return render_registries([lg.registry for lg in self.loggers])


class _MergedCollector:
    """Yields the metric families of several registries, those of one name merged into one
    (an exposition may name each family once)."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterable[Any]:
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():  # fresh objects on every collect
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return families.values()


def render_registries(registries: list[CollectorRegistry]) -> bytes:
    """The text exposition of these registries; in multiprocess mode, of every process's
    metrics instead (they all write to PROMETHEUS_MULTIPROC_DIR)."""
    merged = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(merged)
    else:
        merged.register(_MergedCollector(registries))
    return generate_latest(merged)
