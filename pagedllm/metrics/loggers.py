"""Stat loggers: what the front end does with `SchedulerStats` and `IterationStats`.

Every logger has `record(scheduler_stats, iteration_stats)` (called once per batch of engine
outputs, either argument may be None) and `log()` (called periodically by the engine's stats
task). `LoggingStatLogger` prints vLLM's periodic throughput line; `PrometheusStatLogger`
(metrics/prometheus.py) feeds the `/metrics` endpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, runtime_checkable

from pagedllm.engine import EngineSnapshot, SchedulerStats
from pagedllm.metrics.stats import IterationStats
from pagedllm.spec_decode.metrics import SpecDecodingLogging

logger = logging.getLogger(__name__)


class StatLoggerBase(Protocol):
    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None: ...

    def log(self) -> None: ...


@runtime_checkable
class EngineSnapshotLogger(Protocol):
    """A stat logger that also takes the engine core's dashboard snapshots
    (`AsyncLLM.set_engine_snapshots`)."""

    def record_snapshot(self, snapshot: EngineSnapshot) -> None: ...


class PrefixCacheRate:
    """Hit rate over a sliding window of the most recent `max_queries` queried tokens."""

    def __init__(self, max_queries: int = 1000) -> None:
        self.max_queries = max_queries
        self._window: list[tuple[int, int]] = []  # (queries, hits) per record
        self._queries = 0
        self._hits = 0

    def observe(self, queries: int, hits: int) -> None:
        if queries <= 0:
            return
        self._window.append((queries, hits))
        self._queries += queries
        self._hits += hits
        while len(self._window) > 1 and self._queries - self._window[0][0] >= self.max_queries:
            q, h = self._window.pop(0)
            self._queries -= q
            self._hits -= h

    @property
    def hit_rate(self) -> float:
        return self._hits / self._queries if self._queries else 0.0


class LoggingStatLogger:
    """Logs one line per `log()` interval while the engine is busy (silent when idle):

    `Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
    Running: R reqs, Waiting: W reqs, KV cache usage: U%, Prefix cache hit rate: H%`
    """

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.prefix_cache = PrefixCacheRate()
        self.spec_decoding = SpecDecodingLogging()
        self.last_scheduler_stats = SchedulerStats()
        self._reset(time.monotonic())
        self._last_generation_throughput = 0.0
        self._last_prompt_throughput = 0.0

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.prefix_cache.observe(
                scheduler_stats.prefix_cache_queries, scheduler_stats.prefix_cache_hits
            )
            self.last_scheduler_stats = scheduler_stats
            self.spec_decoding.observe(scheduler_stats.spec_decode)

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-6)
        prompt_tput = self.num_prompt_tokens / elapsed
        gen_tput = self.num_generation_tokens / elapsed
        stats = self.last_scheduler_stats
        idle = (
            prompt_tput == 0
            and gen_tput == 0
            and self._last_prompt_throughput == 0
            and self._last_generation_throughput == 0
            and stats.num_running_reqs == 0
            and stats.num_waiting_reqs == 0
        )
        self._reset(now)
        self._last_prompt_throughput, self._last_generation_throughput = prompt_tput, gen_tput
        if idle:
            return
        logger.info(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, "
            "Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, "
            "KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.engine_index,
            prompt_tput,
            gen_tput,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            self.prefix_cache.hit_rate * 100,
        )
        self.spec_decoding.log(logger, self.engine_index)
