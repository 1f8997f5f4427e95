"""`PrometheusStatLogger`: vLLM's Prometheus metrics, named `pagedllm:*`, in a private registry.

Each instance owns its `CollectorRegistry` (never the process-global one), so several engines
in one process (tests) do not collide; `/metrics` renders `generate_latest(logger.registry)`.
Every metric carries the labels `model_name` and `engine`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine import SchedulerStats
from pagedllm.metrics.stats import IterationStats
from pagedllm.spec_decode.metrics import SpecDecodingProm

# Bucket edges as vLLM uses them (seconds / tokens).
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
_E2E_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
_FINISH_REASONS = ("stop", "length", "abort")


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[float] = []
    mantissa = (1, 2, 5)
    exponent = 0
    while True:
        for m in mantissa:
            value = m * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


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
        num_blocks: int = 0,
        block_size: int = 16,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, str(engine_index))
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=reg).labels(
                *values
            )

        self.running = gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.cache_blocks = gauge("num_kv_cache_blocks", "Number of KV-cache blocks.")
        self.cache_blocks.set(num_blocks)
        self.block_size = gauge("kv_cache_block_size", "Tokens per KV-cache block.")
        self.block_size.set(block_size)
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix-cache queries, in tokens queried."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens hit.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "pagedllm:request_success",
            "Count of finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.request_success = {r: success.labels(*values, r) for r in _FINISH_REASONS}
        self._success_family = success
        self._values = values
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.", _E2E_BUCKETS
        )
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generation tokens per finished request.", token_buckets
        )
        self.spec_decoding = SpecDecodingProm(reg, labels, values)

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
            if scheduler_stats.num_blocks_total:
                self.cache_blocks.set(scheduler_stats.num_blocks_total)
            self.spec_decoding.observe(scheduler_stats.spec_decode)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            reason = finished.finish_reason
            if reason not in self.request_success:
                self.request_success[reason] = self._success_family.labels(*self._values, reason)
            self.request_success[reason].inc()
            self.e2e.observe(finished.e2e_latency)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)

    def log(self) -> None:
        pass

    def render(self) -> bytes:
        """The Prometheus text exposition of this logger's registry."""
        return generate_latest(self.registry)
