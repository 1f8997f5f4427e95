"""`pagedllm tune`: find the engine configuration with the highest goodput under an SLO.

    pagedllm tune --model DIR --dataset random --slo "ttft_p99<=500ms,tpot_p99<=50ms"
        [--time-budget-s 1800] [--output-dir tune-results]

Algorithm. The grid is the product of the knob lists (`--max-num-seqs`,
`--max-num-batched-tokens`, `--enable-chunked-prefill`, `--long-prefill-token-threshold`;
without chunked prefill the threshold has no effect and takes only its first value). Each
configuration gets its own `pagedllm serve` (a child process on a free port, stopped when the
configuration is done, on an error and on Ctrl-C / SIGTERM), and `bench serve`'s client
(`benchmarks/serve.py`) sends the same workload to it at increasing request rates
(`--request-rates`, default 1, 2, 4, ... `--max-rate`) until a rate misses the SLO. Every
point is kept; the best is the point meeting the SLO with the highest goodput
(`tune_report.py`). The sweep stops when the grid is done or `--time-budget-s` runs out (a
point that would not finish in time is not started; one overtaken by the deadline is
dropped), then writes, in `--output-dir`: `best_config.yaml` (for `pagedllm serve --config`;
absent when nothing met the SLO), `report.md`, `frontier.png` (every configuration tried)
and `results.json`. Exit status 0 with a best configuration, 1 without.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from pagedllm.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests
from pagedllm.benchmarks.metrics import calculate_metrics
from pagedllm.benchmarks.server_process import ServerProcess
from pagedllm.benchmarks.tune_report import (
    Point,
    SLOTerm,
    best_point,
    config_label,
    config_yaml,
    flags_to_config,
    goodput_limits,
    markdown_report,
    parse_slo,
    plot_frontier,
    results_json,
)

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument(
        "--slo", required=True, help="e.g. 'ttft_p99<=500ms,tpot_p99<=50ms' (see report)"
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="'random' or a ShareGPT JSON file (shorthand for --dataset-name/--dataset-path)",
    )
    parser.add_argument("--time-budget-s", type=float, default=1800.0)
    parser.add_argument("--output-dir", default="tune-results")
    parser.add_argument("--max-num-seqs", type=_int_list, default=[16, 64, 256])
    parser.add_argument("--max-num-batched-tokens", type=_int_list, default=[512, 2048, 8192])
    parser.add_argument("--enable-chunked-prefill", type=_bool_list, default=[True, False])
    parser.add_argument("--long-prefill-token-threshold", type=_int_list, default=[0])
    parser.add_argument(
        "--request-rates", type=_float_list, default=None, help="default: 1, 2, 4, ... --max-rate"
    )
    parser.add_argument("--max-rate", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `pagedllm serve` flags for every configuration, one string "
        "(e.g. '--dtype float32 --kv-cache-memory-bytes 4G'); they go into the YAML too",
    )
    add_dataset_args(parser, default_num_prompts=100)


def _number_list(kind: type, positive: bool) -> Any:
    """An argparse type: comma-separated `kind` values, each >= 0 (or > 0 if `positive`)."""

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {kind.__name__}s"
            ) from None
        if not values or min(values) < 0 or (positive and min(values) == 0):
            sign = "positive" if positive else "non-negative"
            raise argparse.ArgumentTypeError(f"{text!r}: give {sign} values, e.g. 16,64")
        return values

    return parse


_int_list = _number_list(int, positive=False)
_float_list = _number_list(float, positive=True)


def _bool_list(text: str) -> list[bool]:
    words = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not values or any(v not in words for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give true/false values, e.g. true,false")
    return [words[v] for v in values]


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The grid, in sweep order, without configurations that differ in nothing that acts."""
    grid = []
    for seqs, tokens, chunked, lpt in itertools.product(
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.enable_chunked_prefill,
        args.long_prefill_token_threshold,
    ):
        if not chunked and lpt != args.long_prefill_token_threshold[0]:
            continue
        grid.append(
            {
                "max_num_seqs": seqs,
                "max_num_batched_tokens": tokens,
                "enable_chunked_prefill": chunked,
                "long_prefill_token_threshold": lpt,
            }
        )
    return grid


def rate_ladder(args: argparse.Namespace) -> list[float]:
    if args.request_rates:
        return sorted(args.request_rates)
    rates, r = [], 1.0
    while r <= args.max_rate:
        rates.append(r)
        r *= 2
    return rates


def knob_flags(config: dict[str, Any]) -> list[str]:
    chunked = (
        "--enable-chunked-prefill"
        if config["enable_chunked_prefill"]
        else "--no-enable-chunked-prefill"
    )
    return [
        "--max-num-seqs", str(config["max_num_seqs"]),
        "--max-num-batched-tokens", str(config["max_num_batched_tokens"]),
        chunked,
        "--long-prefill-token-threshold", str(config["long_prefill_token_threshold"]),
    ]  # fmt: skip


def _bench_args(rate: float, seed: int) -> argparse.Namespace:
    """What `serve.run_benchmark` reads: streaming completions, EOS ignored (the output
    lengths are the workload's), Poisson arrivals at `rate`."""
    from pagedllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([])  # bench serve's defaults for everything else
    args.__dict__.update(
        endpoint="/v1/completions", max_concurrency=None, temperature=0.0, ignore_eos=True,
        api_key=None, request_rate=rate, burstiness=1.0, disable_tqdm=True, seed=seed,
    )  # fmt: skip
    return args


def measure_point(
    url: str,
    model_name: str,
    requests: list[SampleRequest],
    config: dict[str, Any],
    rate: float,
    terms: list[SLOTerm],
    seed: int = 0,
    timeout_s: float | None = None,
) -> Point:
    """Run the workload against the server at `url` at `rate` (bench serve's client) and
    summarize it for the SLO. TimeoutError after `timeout_s`."""
    from pagedllm.benchmarks.serve import run_benchmark

    percentiles = sorted({t.percentile for t in terms if t.percentile is not None} | {99.0})
    coro = run_benchmark(_bench_args(rate, seed), requests, url, model_name)
    with contextlib.redirect_stdout(io.StringIO()):  # bench serve's own progress lines
        outputs, duration = asyncio.run(asyncio.wait_for(coro, timeout_s))
    metrics = calculate_metrics(outputs, duration, percentiles, goodput_limits(terms) or None)
    stats = {}
    for t in terms:
        if t.percentile is None:
            stats[t.key] = getattr(metrics, f"{t.stat}_{t.metric}_ms")
        else:
            pairs = dict(getattr(metrics, f"percentiles_{t.metric}_ms"))
            stats[t.key] = pairs[t.percentile]
    return Point(
        config=dict(config),
        request_rate=rate,
        completed=metrics.completed,
        failed=len(outputs) - metrics.completed,
        duration_s=duration,
        request_throughput=metrics.request_throughput,
        # Without TTFT / TPOT / E2EL terms every successful request counts.
        goodput=metrics.request_goodput if goodput_limits(terms) else metrics.request_throughput,
        output_throughput=metrics.output_throughput,
        stats=stats,
    )


class _ServerFailed(RuntimeError):
    """A configuration's server exited before it was ready (bad flags, out of memory)."""


# Kept for the end: stopping the last server, the plot and the report.
_FINISH_RESERVE_S = 5.0


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + seconds - min(_FINISH_RESERVE_S, seconds / 4)

    def left(self) -> float:
        return self.deadline - time.monotonic()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the `with` blocks stop their servers."""

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, raise_interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sweep(
    args: argparse.Namespace,
    terms: list[SLOTerm],
    requests: list[SampleRequest],
    budget: _Budget,
    points: list[Point],
    tried: list[dict[str, Any]],
) -> str:
    """Measure the grid into `points` (configurations started into `tried`); returns why it
    stopped."""
    serve_args = shlex.split(args.serve_args)
    grid = configurations(args)
    rates = rate_ladder(args)
    start_cost = 0.0  # the last server start, to judge whether another fits
    for i, config in enumerate(grid):
        label = config_label(config)
        if budget.left() < start_cost + 1.0:
            return "time budget reached"
        logger.info("[%d/%d] %s: starting a server", i + 1, len(grid), label)
        log_path = os.path.join(args.output_dir, f"server-{i + 1}.log")
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            server = ServerProcess(args.model, [*knob_flags(config), *serve_args], log=log)
            try:
                try:
                    server.wait_ready(timeout_s=max(budget.left(), 0.1))
                except TimeoutError:
                    return "time budget reached while a server started"
                except RuntimeError as e:
                    raise _ServerFailed(f"{label}: {e}; its log: {log_path}") from None
                tried.append(config)
                start_cost = time.monotonic() - t0
                stop = _sweep_rates(
                    args, config, rates, terms, requests, server.url, budget, points
                )
            finally:
                server.stop()
        if stop:
            return stop
    return "grid done"


def _sweep_rates(args, config, rates, terms, requests, url, budget, points) -> str | None:
    label = config_label(config)
    last_duration = None
    for rate in rates:
        expected = last_duration or len(requests) / rate
        if budget.left() < expected:
            return "time budget reached"
        try:
            point = measure_point(
                url, args.model, requests, config, rate, terms, args.seed, budget.left()
            )
        except TimeoutError:
            return "time budget reached (the last point was dropped)"
        points.append(point)
        last_duration = point.duration_s * 1.2
        why = point.violations(terms)
        logger.info(
            "  %s @ %g req/s: goodput %.2f req/s, %.1f output tok/s, %s -> %s",
            label, rate, point.goodput, point.output_throughput,
            ", ".join(f"{t.metric}_{t.stat} {point.stats[t.key]:.1f} ms" for t in terms),
            "meets the SLO" if not why else "misses: " + "; ".join(why),
        )  # fmt: skip
        if why:
            break  # higher rates only queue more
    return None


def main(args: argparse.Namespace) -> int:
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    terms = parse_slo(args.slo)
    if args.dataset is not None:
        if args.dataset == "random":
            args.dataset_name = "random"
        else:
            args.dataset_name, args.dataset_path = "sharegpt", args.dataset
    if not args.time_budget_s > 0:
        raise ValueError(f"--time-budget-s={args.time_budget_s} must be positive")
    serve_flags = flags_to_config(shlex.split(args.serve_args))
    if not configurations(args):
        raise ValueError("the knob lists give no configuration")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    budget = _Budget(args.time_budget_s)
    os.makedirs(args.output_dir, exist_ok=True)
    requests = get_requests(args, get_tokenizer(args.model, False))
    points: list[Point] = []
    tried: list[dict[str, Any]] = []
    try:
        with _sigterm_as_interrupt():
            stop_reason = sweep(args, terms, requests, budget, points, tried)
    except KeyboardInterrupt:
        stop_reason = "interrupted"
    except _ServerFailed as e:
        logger.error("a server did not start: %s", e)
        stop_reason = f"stopped: a server did not start ({e})"
    best = best_point(points, terms)
    untried = [c for c in configurations(args) if c not in tried]
    out = args.output_dir
    plotted = plot_frontier(points, terms, best, os.path.join(out, "frontier.png"))
    yaml_path = os.path.join(out, "best_config.yaml")
    if best is not None:
        with open(yaml_path, "w") as f:
            f.write(config_yaml(args.model, best.config, serve_flags))
    elif os.path.exists(yaml_path):
        os.remove(yaml_path)  # a stale one from an earlier run would mislead
    from_cli = sys.argv[1:2] == ["tune"]
    command = "pagedllm " + shlex.join(sys.argv[1:]) if from_cli else "(called from Python)"
    elapsed = time.monotonic() - budget.start
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(
            markdown_report(
                command, terms, points, best, tried, untried, stop_reason, elapsed,
                args.time_budget_s,
            )
        )  # fmt: skip
    with open(os.path.join(out, "results.json"), "w") as f:
        f.write(results_json(terms, points, best, plotted, stop_reason))
    if best is None:
        print(
            f"No configuration met the SLO ({len(points)} point(s) measured); see {out}/report.md"
        )
        return 1
    print(
        f"Best: {config_label(best.config)} at {best.request_rate:g} req/s, goodput "
        f"{best.goodput:.2f} req/s; wrote {yaml_path} and {out}/report.md"
    )
    return 0
