"""Serving-metric arithmetic on synthetic timings, checked against values worked out by hand."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.metrics import (
    RequestFuncOutput,
    calculate_metrics,
    latency_percentiles,
    meets_slos,
    output_len_of,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    percentile_label,
    time_per_output_token,
)


def _outputs() -> list[RequestFuncOutput]:
    """Three successes and one failure over a 2 s run.

    A: TTFT 0.1 s, 5 tokens, latency 0.5 s -> TPOT 0.4 / 4 = 100 ms, gaps 4 x 100 ms.
    B: TTFT 0.3 s, 4 tokens, latency 0.9 s -> TPOT 0.6 / 3 = 200 ms, gaps 3 x 200 ms.
    C: TTFT 0.2 s, 1 token -> no TPOT, no gaps.
    D: failed (its 100 prompt tokens must not count).
    """
    return [
        RequestFuncOutput(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestFuncOutput(True, 20, 4, ttft=0.3, latency=0.9, itl=[0.2] * 3),
        RequestFuncOutput(True, 5, 1, ttft=0.2, latency=0.2, itl=[]),
        RequestFuncOutput(False, 100, None, error="boom"),
    ]


def test_tpot_definition():
    assert time_per_output_token(latency=0.5, ttft=0.1, output_len=5) == pytest.approx(0.1)
    assert time_per_output_token(latency=0.2, ttft=0.2, output_len=1) is None
    assert time_per_output_token(latency=0.2, ttft=0.2, output_len=0) is None


def test_counts_and_throughputs():
    m = calculate_metrics(_outputs(), duration_s=2.0)
    assert m.completed == 3
    assert m.total_input == 35
    assert m.total_output == 10
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(22.5)


def test_ttft_tpot_e2el_are_per_request():
    m = calculate_metrics(_outputs(), duration_s=2.0, selected_percentiles=[50, 99])
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    # numpy's linear interpolation over [100, 200, 300]: 200 + 0.98 * 100.
    assert m.percentiles_ttft_ms == [(50.0, pytest.approx(200.0)), (99.0, pytest.approx(298.0))]
    # TPOT only over A and B (C has one token): mean of 100 and 200.
    assert m.mean_tpot_ms == pytest.approx(150.0)
    assert m.std_tpot_ms == pytest.approx(50.0)
    assert m.mean_e2el_ms == pytest.approx(1600.0 / 3)


def test_itl_is_pooled_over_all_gaps():
    m = calculate_metrics(_outputs(), duration_s=2.0, selected_percentiles=[50])
    # 4 gaps of 100 ms and 3 of 200 ms pooled: 1000 / 7, not the per-request mean 150.
    assert m.mean_itl_ms == pytest.approx(1000.0 / 7)
    assert m.median_itl_ms == pytest.approx(100.0)
    assert m.percentiles_itl_ms == [(50.0, pytest.approx(100.0))]


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 250}, 2),  # A (100) and C (200) meet it, B (300) does not
        ({"ttft": 250, "tpot": 150}, 2),  # C's TPOT counts as 0
        ({"tpot": 50}, 1),  # only C
        ({"e2el": 400}, 1),  # only C (200 ms)
        ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),
        ({"ttft": 50}, 0),
    ],
)
def test_goodput(slos, good):
    m = calculate_metrics(_outputs(), duration_s=2.0, goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_goodput_bound_is_inclusive():
    out = RequestFuncOutput(True, 1, 3, ttft=0.25, latency=0.75, itl=[0.25, 0.25])
    assert meets_slos(out, {"ttft": 250, "tpot": 250, "e2el": 750})
    assert not meets_slos(out, {"tpot": 249.9})


def test_no_goodput_without_slos():
    assert calculate_metrics(_outputs(), duration_s=2.0).request_goodput == 0.0


def test_output_len_falls_back_to_chunks():
    assert output_len_of(RequestFuncOutput(True, 1, None, itl=[0.1, 0.1, 0.1])) == 4
    assert output_len_of(RequestFuncOutput(False, 1, None)) == 0
    assert output_len_of(RequestFuncOutput(True, 1, 7, itl=[0.1])) == 7


def test_all_failed_gives_zeros():
    m = calculate_metrics([RequestFuncOutput(False, 9)], duration_s=1.0)
    assert m.completed == 0 and m.total_input == 0 and m.total_output == 0
    assert m.mean_ttft_ms == 0.0 and m.percentiles_itl_ms == [(99.0, 0.0)]


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics(_outputs(), duration_s=0.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:0"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 0.0,
    }
    assert parse_goodput(None) == {}
    for bad in ("itl:5", "ttft", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_parse_percentiles_and_metrics():
    assert parse_metric_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert parse_percentile_metrics("ttft, itl,E2EL") == ["ttft", "itl", "e2el"]
    for bad in ("0", "101", "p99"):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_metric_percentiles(bad)
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_percentile_metrics("ttft,latency")


def test_percentile_label():
    assert percentile_label(99.0) == "99"
    assert percentile_label(99.9) == "99.9"


def test_latency_percentiles():
    pcts = latency_percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert pcts == {
        "10": pytest.approx(1.4),
        "25": pytest.approx(2.0),
        "50": pytest.approx(3.0),
        "75": pytest.approx(4.0),
        "90": pytest.approx(4.6),
        "99": pytest.approx(4.96),
    }
    with pytest.raises(ValueError):
        latency_percentiles([])
