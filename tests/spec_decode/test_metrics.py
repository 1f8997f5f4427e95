"""Spec-decode metrics: vLLM's Prometheus counters and the logged mean acceptance length."""

from __future__ import annotations

import logging

from pagedllm.engine import SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.spec_decode.metrics import SpecDecodingStats


def _stats() -> SchedulerStats:
    counts = SpecDecodingStats(num_spec_tokens=3)
    counts.observe_draft(3, 3)
    counts.observe_draft(3, 1)
    counts.observe_draft(2, 0)
    return SchedulerStats(num_running_reqs=1, spec_decode=counts.take())


def test_stats_counts_and_reset():
    stats = _stats().spec_decode
    assert stats == {
        "num_spec_tokens": 3,
        "num_drafts": 3,
        "num_draft_tokens": 8,
        "num_accepted_tokens": 4,
        "num_accepted_tokens_per_pos": [2, 1, 1],
    }


def test_prometheus_counters():
    prom = PrometheusStatLogger("m")
    assert b"spec_decode" not in prom.render()  # registered only once drafts are verified
    prom.record(_stats(), None)
    prom.record(_stats(), None)
    text = prom.render().decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 6.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 16.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 8.0" in text
    per_pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m"'
    assert f'{per_pos},position="0"}} 4.0' in text
    assert f'{per_pos},position="2"}} 2.0' in text


def test_logging_stat_logger_prints_mean_acceptance_length(caplog):
    stat_logger = LoggingStatLogger()
    stat_logger.record(_stats(), None)
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        stat_logger.log()
    line = next(r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage())
    assert "Mean acceptance length: 2.33" in line
    assert "Draft acceptance rate: 50.0%" in line
    assert "Per-position acceptance rate: 0.667, 0.333, 0.333" in line
