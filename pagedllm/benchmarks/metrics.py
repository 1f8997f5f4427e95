"""Serving-benchmark metrics: pure functions over per-request timings.

Definitions (vLLM's, so figures compare directly):

- TTFT: time from sending a request to receiving its first streamed token.
- TPOT: `(latency - TTFT) / (output_tokens - 1)`, only for requests with more than one output
  token; the mean and percentiles are taken over requests.
- ITL: the gaps between consecutive streamed chunks, pooled over all requests (a long request
  weighs more than a short one, unlike TPOT).
- E2EL: a request's whole latency.
- Goodput: requests that meet every configured SLO (TTFT, TPOT, E2EL in ms), divided by the
  benchmark duration. A request with a single output token has TPOT 0 for this check.
- Throughputs divide the successful requests' token counts by the benchmark duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
_MS_PER_S = 1000.0


@dataclass
class RequestFuncOutput:
    """What one request of a serving benchmark measured (times in seconds)."""

    success: bool = False
    prompt_len: int = 0
    # Output tokens as the server reported them (usage), or None to count from `itl`.
    output_tokens: int | None = None
    ttft: float = 0.0
    latency: float = 0.0
    # Gaps between consecutive streamed chunks after the first one.
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0


@dataclass
class BenchmarkMetrics:
    """Aggregates of a serving benchmark; `*_ms` fields are milliseconds.

    `percentiles_<metric>_ms` lists `(percentile, value_ms)` pairs in the requested order.
    """

    completed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    percentiles_ttft_ms: list[tuple[float, float]]
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    percentiles_tpot_ms: list[tuple[float, float]]
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    percentiles_itl_ms: list[tuple[float, float]]
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: list[tuple[float, float]]


def output_len_of(output: RequestFuncOutput) -> int:
    """Tokens a successful request generated: the server's count, else one per chunk."""
    if output.output_tokens is not None:
        return output.output_tokens
    return len(output.itl) + 1 if output.success else 0


def time_per_output_token(latency: float, ttft: float, output_len: int) -> float | None:
    """TPOT in seconds, or None when there is no second token to time."""
    if output_len <= 1:
        return None
    return (latency - ttft) / (output_len - 1)


def percentile_stats(
    values_s: Sequence[float], percentiles: Sequence[float]
) -> tuple[float, float, float, list[tuple[float, float]]]:
    """Mean, median, std and the given percentiles of `values_s`, converted to ms.

    An empty sequence gives zeros (a benchmark where nothing succeeded still prints).
    """
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * _MS_PER_S
    pcts = [(float(p), float(np.percentile(arr, p))) for p in percentiles]
    return float(np.mean(arr)), float(np.median(arr)), float(np.std(arr)), pcts


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse `["ttft:500", "tpot:50"]` into `{"ttft": 500.0, "tpot": 50.0}` (ms)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput entry {item!r} must be NAME:MS with NAME one of {list(GOODPUT_METRICS)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput entry {item!r}: {value!r} is not a number") from None
        if ms < 0:
            raise ValueError(f"--goodput entry {item!r}: the SLO must be non-negative")
        slos[name] = ms
    return slos


def parse_percentile_metrics(text: str) -> list[str]:
    """Parse `"ttft,tpot,itl"`; an unknown name is a ValueError."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in PERCENTILE_METRICS:
            raise ValueError(
                f"--percentile-metrics: unknown metric {name!r}; choose from "
                f"{list(PERCENTILE_METRICS)}"
            )
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    """Parse `"50,90,99"`; each value must lie in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r} must be numbers like 50,90,99") from None
    for p in values:
        if not 0 < p <= 100:
            raise ValueError(f"--metric-percentiles: {p} is outside (0, 100]")
    return values


def meets_slos(output: RequestFuncOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (a one-token request has TPOT 0)."""
    tpot = time_per_output_token(output.latency, output.ttft, output_len_of(output)) or 0.0
    measured = {"ttft": output.ttft, "tpot": tpot, "e2el": output.latency}
    return all(measured[name] * _MS_PER_S <= slo for name, slo in slos_ms.items())


def calculate_metrics(
    outputs: Sequence[RequestFuncOutput],
    duration_s: float,
    selected_percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request outputs of a run that lasted `duration_s` seconds.

    Failed requests count towards nothing (not even input tokens).
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be positive")
    done = [o for o in outputs if o.success]
    output_lens = [output_len_of(o) for o in done]
    tpots = [
        t
        for o, n in zip(done, output_lens)
        if (t := time_per_output_token(o.latency, o.ttft, n)) is not None
    ]
    itls = [gap for o in done for gap in o.itl]
    ttfts = [o.ttft for o in done]
    e2els = [o.latency for o in done]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(output_lens)
    good = sum(meets_slos(o, goodput_slos_ms) for o in done) if goodput_slos_ms else 0

    stats = {}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        mean, median, std, pcts = percentile_stats(values, selected_percentiles)
        stats[f"mean_{name}_ms"] = mean
        stats[f"median_{name}_ms"] = median
        stats[f"std_{name}_ms"] = std
        stats[f"percentiles_{name}_ms"] = pcts
    return BenchmarkMetrics(
        completed=len(done),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        **stats,
    )


def latency_percentiles(
    latencies_s: Sequence[float], percentages: Sequence[int] = (10, 25, 50, 75, 90, 99)
) -> dict[str, float]:
    """`{"10": p10, ...}` of a latency benchmark's per-iteration latencies, in seconds."""
    arr = np.asarray(latencies_s, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("no latencies measured (num_iters must be positive)")
    return {str(p): float(np.percentile(arr, p)) for p in percentages}


def percentile_label(p: float) -> str:
    """`99.0 -> "99"`, `99.9 -> "99.9"` (the label in printed lines and JSON keys)."""
    return str(int(p)) if int(p) == p else str(p)
