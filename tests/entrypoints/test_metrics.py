"""Stat loggers: Prometheus names and values from SchedulerStats / IterationStats, private
registries, and the periodic log line."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine import SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger, PrefixCacheRate
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats


def _samples(logger: PrometheusStatLogger) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for s in family.samples:
            key = s.name
            if "finished_reason" in s.labels:
                key += f"[{s.labels['finished_reason']}]"
            if "le" in s.labels:
                continue
            values[key] = s.value
    return values


def _iteration() -> IterationStats:
    return IterationStats(
        num_prompt_tokens=10,
        num_generation_tokens=4,
        time_to_first_tokens=[0.05],
        inter_token_latencies=[0.01, 0.02],
        finished_requests=[
            FinishedRequestStats("length", 0.3, 10, 4, 0.05),
            FinishedRequestStats("stop", 0.2, 3, 2, 0.04),
        ],
    )


def test_prometheus_names_and_values():
    logger = PrometheusStatLogger("m", max_model_len=128, num_blocks=100, block_size=16)
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.25,
            prefix_cache_queries=40,
            prefix_cache_hits=16,
            num_preemptions=1,
        ),
        _iteration(),
    )
    logger.record(SchedulerStats(), None)  # gauges follow the latest stats, counters add
    v = _samples(logger)
    assert v["pagedllm:num_requests_running"] == 0
    assert v["pagedllm:num_requests_waiting"] == 0
    assert v["pagedllm:kv_cache_usage_perc"] == 0
    assert v["pagedllm:num_preemptions_total"] == 1
    assert v["pagedllm:prefix_cache_queries_total"] == 40
    assert v["pagedllm:prefix_cache_hits_total"] == 16
    assert v["pagedllm:prompt_tokens_total"] == 10
    assert v["pagedllm:generation_tokens_total"] == 4
    assert v["pagedllm:request_success_total[length]"] == 1
    assert v["pagedllm:request_success_total[stop]"] == 1
    assert v["pagedllm:request_success_total[abort]"] == 0
    assert v["pagedllm:time_to_first_token_seconds_count"] == 1
    assert v["pagedllm:inter_token_latency_seconds_count"] == 2
    assert v["pagedllm:e2e_request_latency_seconds_count"] == 2
    assert abs(v["pagedllm:e2e_request_latency_seconds_sum"] - 0.5) < 1e-9
    assert v["pagedllm:request_prompt_tokens_sum"] == 13
    assert v["pagedllm:num_kv_cache_blocks"] == 100


def test_prometheus_registries_are_private():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    a.record(None, _iteration())
    assert _samples(a)["pagedllm:prompt_tokens_total"] == 10
    assert _samples(b)["pagedllm:prompt_tokens_total"] == 0


def test_logging_line(caplog):
    logger = LoggingStatLogger()
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        logger.log()  # idle: silent
        assert caplog.records == []
        logger.record(
            SchedulerStats(
                num_running_reqs=2,
                num_waiting_reqs=1,
                kv_cache_usage=0.5,
                prefix_cache_queries=10,
                prefix_cache_hits=5,
            ),
            _iteration(),
        )
        logger.log()
    (record,) = caplog.records
    msg = record.getMessage()
    for part in (
        "Avg prompt throughput",
        "Avg generation throughput",
        "Running: 2 reqs",
        "Waiting: 1 reqs",
        "KV cache usage: 50.0%",
        "Prefix cache hit rate: 50.0%",
    ):
        assert part in msg


def test_prefix_cache_rate_window():
    rate = PrefixCacheRate(max_queries=100)
    rate.observe(100, 100)
    rate.observe(100, 0)
    assert rate.hit_rate == 0.0  # the old, fully-hit window slid out
    rate.observe(100, 50)
    assert rate.hit_rate == 0.5
