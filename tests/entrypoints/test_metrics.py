"""Stat loggers: Prometheus names and values from SchedulerStats / IterationStats, private
registries, and the periodic log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import CacheConfig
from pagedllm.engine import EngineCoreEventType, SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger, PrefixCacheRate
from pagedllm.metrics.prometheus import PrometheusMetrics, PrometheusStatLogger
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats


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


# vLLM's series (v1/metrics/loggers.py: PrometheusStatLogger and SpecDecodingProm), written
# out from its source: name -> (type, label names besides model_name and engine).
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:cache_config_info": ("gauge", None),  # engine + one label per cache setting
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:spec_decode_num_drafts": ("counter", ()),
    "vllm:spec_decode_num_draft_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", ("position",)),
}
# pagedllm's additions, in vLLM's style (metrics/prometheus.py says why).
PAGEDLLM_SERIES = {"vllm:engine_dead": ("gauge", ()), "vllm:engine_stalled": ("gauge", ())}
VLLM_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip


def _finished(reason, e2e, prompt, generated, ttft, **timing) -> FinishedRequestStats:
    return FinishedRequestStats(reason, e2e, prompt, generated, ttft, **timing)


def _iteration() -> IterationStats:
    return IterationStats(
        num_prompt_tokens=10,
        num_generation_tokens=4,
        time_to_first_tokens=[0.05],
        inter_token_latencies=[0.01, 0.02],
        finished_requests=[
            _finished("length", 0.3, 10, 4, 0.05, queued_time=0.1, prefill_time=0.02,
                      decode_time=0.12, inference_time=0.14, mean_time_per_output_token=0.04,
                      max_tokens_param=4),
            _finished("stop", 0.2, 3, 2, 0.04),
        ],
        n_params=[2],
        max_num_generation_tokens=[4],
    )  # fmt: skip


def test_series_are_vllms():
    """Every series pagedllm exposes is one of vLLM's (or a documented addition), with vLLM's
    type and labels."""
    logger = PrometheusStatLogger("m", max_model_len=128, cache_config=CacheConfig(num_blocks=7))
    logger.record(SchedulerStats(spec_decode=_spec_counts()), _iteration())
    families = {f.name: f for f in text_string_to_metric_families(logger.render().decode())}
    # prometheus_client's text format adds a `<counter/histogram>_created` gauge beside each.
    series = VLLM_SERIES | PAGEDLLM_SERIES
    assert {n for n in families if not n.endswith("_created")} == set(series)
    for name, (kind, extra_labels) in series.items():
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert sample.labels["engine"] == "0"
            if extra_labels is not None:  # (vLLM's info gauge has no model_name)
                assert sample.labels["model_name"] == "m"
                assert set(sample.labels) - {"model_name", "engine", "le"} == set(extra_labels)
    ttft = families["vllm:time_to_first_token_seconds"].samples
    assert [float(s.labels["le"]) for s in ttft if "le" in s.labels][:-1] == VLLM_TTFT_BUCKETS
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["num_gpu_blocks"] == "7" and info["block_size"] == "16"


def _spec_counts():
    from pagedllm.spec_decode.metrics import SpecDecodingStats

    counts = SpecDecodingStats(num_spec_tokens=2)
    counts.observe_draft(2, 1)
    return counts.take()


def test_prometheus_values():
    logger = PrometheusStatLogger("m", max_model_len=128)
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
    assert v["vllm:num_requests_running"] == 0
    assert v["vllm:num_requests_waiting"] == 0
    assert v["vllm:kv_cache_usage_perc"] == 0
    assert v["vllm:num_preemptions_total"] == 1
    assert v["vllm:prefix_cache_queries_total"] == 40
    assert v["vllm:prefix_cache_hits_total"] == 16
    assert v["vllm:prompt_tokens_total"] == 10
    assert v["vllm:generation_tokens_total"] == 4
    assert v["vllm:request_success_total[length]"] == 1
    assert v["vllm:request_success_total[stop]"] == 1
    assert v["vllm:request_success_total[abort]"] == 0
    assert v["vllm:time_to_first_token_seconds_count"] == 1
    assert v["vllm:inter_token_latency_seconds_count"] == 2
    assert v["vllm:e2e_request_latency_seconds_count"] == 2
    assert abs(v["vllm:e2e_request_latency_seconds_sum"] - 0.5) < 1e-9
    assert v["vllm:request_prompt_tokens_sum"] == 13
    assert v["vllm:iteration_tokens_total_sum"] == 14
    assert v["vllm:request_params_n_sum"] == 2
    assert v["vllm:request_max_num_generation_tokens_sum"] == 4
    assert v["vllm:request_params_max_tokens_count"] == 1  # only requests that set it
    assert abs(v["vllm:request_queue_time_seconds_sum"] - 0.1) < 1e-9
    assert abs(v["vllm:request_prefill_time_seconds_sum"] - 0.02) < 1e-9
    assert abs(v["vllm:request_decode_time_seconds_sum"] - 0.12) < 1e-9
    assert abs(v["vllm:request_inference_time_seconds_sum"] - 0.14) < 1e-9
    assert abs(v["vllm:request_time_per_output_token_seconds_sum"] - 0.04) < 1e-9


def test_prometheus_registries_are_private():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    a.record(None, _iteration())
    assert _samples(a)["vllm:prompt_tokens_total"] == 10
    assert _samples(b)["vllm:prompt_tokens_total"] == 0


def test_one_exposition_for_every_engine():
    """A front end over two data-parallel engines: each series once, a sample per engine,
    each engine's own KV-cache size in its cache_config_info."""
    metrics = PrometheusMetrics("m", [CacheConfig(num_blocks=7), CacheConfig(num_blocks=9)], 128)
    metrics.for_engine(1).record(SchedulerStats(num_running_reqs=2), _iteration())
    metrics.for_engine(1).engine_dead.set(1)
    families = list(text_string_to_metric_families(metrics.render().decode()))
    assert len({f.name for f in families}) == len(families)
    by_name = {f.name: f for f in families}

    def per_engine(name: str) -> dict[str, float]:
        return {s.labels["engine"]: s.value for s in by_name[name].samples if s.name == name}

    assert per_engine("vllm:num_requests_running") == {"0": 0, "1": 2}
    assert per_engine("vllm:engine_dead") == {"0": 0, "1": 1}
    prompt = by_name["vllm:prompt_tokens"].samples
    assert {s.labels["engine"]: s.value for s in prompt if s.name.endswith("_total")} == {
        "0": 0,
        "1": 10,
    }
    info = {
        s.labels["engine"]: s.labels["num_gpu_blocks"]
        for s in by_name["vllm:cache_config_info"].samples
    }
    assert info == {"0": "7", "1": "9"}


def test_request_phases_from_engine_timestamps():
    """Queue, prefill, decode and inference times come from the core's events and step
    timestamps; TTFT and inter-token latency from the front end's clock."""
    stats = RequestStateStats(arrival_time=100.0)
    stats.observe_events([(EngineCoreEventType.QUEUED, 5.0), (EngineCoreEventType.SCHEDULED, 5.5)])
    it = IterationStats()
    stats.observe_tokens(1, 7, now=100.9, engine_ts=6.0, it=it)
    stats.observe_events(
        [(EngineCoreEventType.PREEMPTED, 6.2), (EngineCoreEventType.SCHEDULED, 6.4)]
    )
    stats.observe_tokens(2, 7, now=101.5, engine_ts=7.0, it=it)
    assert it.num_prompt_tokens == 7 and it.num_generation_tokens == 3
    assert it.time_to_first_tokens == [pytest.approx(0.9)]
    assert it.inter_token_latencies == [pytest.approx(0.6)]
    done = stats.finished("stop", now=102.0, num_prompt_tokens=7, num_cached_tokens=0,
                          max_tokens_param=16)  # fmt: skip
    assert done.queued_time == pytest.approx(0.5)  # the first SCHEDULED counts
    assert done.prefill_time == pytest.approx(0.5)
    assert done.decode_time == pytest.approx(1.0)
    assert done.inference_time == pytest.approx(1.5)
    assert done.mean_time_per_output_token == pytest.approx(0.5)  # 1.0 s over 3 - 1 gaps
    assert done.e2e_latency == pytest.approx(2.0) and done.time_to_first_token == pytest.approx(0.9)


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
