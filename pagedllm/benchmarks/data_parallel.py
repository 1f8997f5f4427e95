"""Data parallelism online: D engine cores with C/D threads each vs one engine with C threads,
through `pagedllm serve` and `pagedllm bench serve` at a fixed request rate.

Per repeat, each setting (`--data-parallel-sizes`, default 1 and 2, in alternating order) gets
a fresh server: `pagedllm serve MODEL --data-parallel-size D` with `OMP_NUM_THREADS=C/D` (each
engine's torch threads; `--cores` C, default all) and `--kv-cache-memory-bytes TOTAL/D` (the
same KV memory in all), a short warm-up, then each workload (`--workloads`):

- `fixed`: 64 prompts of 128 random tokens, 128 output tokens each;
- `mixed`: inputs 32-512, outputs 16-256 tokens (uniform), `--mixed-prompts` of them;

sent by `pagedllm bench serve` at `--request-rate` (Poisson arrivals, fixed seed, EOS
ignored). Printed: the median over the repeats of throughput and TTFT / TPOT percentiles,
and D's ratio to the first setting.

    python -m pagedllm.benchmarks.data_parallel --model DIR [--repeats 3] [--request-rate 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from pagedllm.benchmarks.server_process import ServerProcess

# name -> `pagedllm bench serve` dataset flags
WORKLOADS = {
    "fixed": ["--input-len", "128", "--output-len", "128", "--random-range-ratio", "0"],
    # 272 +- 240 in, 136 +- 120 out: the mixed workload of BENCHMARKS.md.
    "mixed": ["--input-len", "272", "--output-len", "136", "--random-range-ratio", "0.8823529"],
}
# (result key as vLLM's result file names it, column header); the ms figures are over
# requests, the throughputs over the whole run.
COLUMNS = [
    ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p90_ttft_ms", "TTFT p90 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p90_tpot_ms", "TPOT p90 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
]


class Server(ServerProcess):
    """`pagedllm serve` with `dp` engines of `threads` threads each; a context manager that
    stops it (SIGTERM, then SIGKILL) and its engines with it."""

    def __init__(self, args: argparse.Namespace, dp: int, threads: int, log: Any) -> None:
        flags = ["--data-parallel-size", str(dp)]
        flags += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes // dp)]
        flags += ["--disable-log-stats", *args.serve_args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        super().__init__(args.model, flags, log=log, env=env)


def bench_serve(url: str, args: argparse.Namespace, flags: list[str], out_dir: str) -> dict:
    """One `pagedllm bench serve` run; returns its `--save-result` JSON."""
    name = f"result-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve"]
    cmd += ["--base-url", url, "--model", args.model, "--dataset-name", "random", *flags]
    cmd += ["--ignore-eos", "--seed", str(args.seed), "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99"]
    cmd += ["--save-result", "--result-dir", out_dir, "--result-filename", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, name)) as f:
        result = json.load(f)
    if result["completed"] != result["num_prompts"]:
        raise RuntimeError(f"{result['num_prompts'] - result['completed']} requests failed")
    return result


def run(args: argparse.Namespace) -> dict[str, dict[int, list[dict]]]:
    """workload -> data-parallel size -> one result per repeat."""
    sizes = args.data_parallel_sizes
    results: dict[str, dict[int, list[dict]]] = {w: {d: [] for d in sizes} for w in args.workloads}
    warmup = ["--num-prompts", "4", "--input-len", "32", "--output-len", "8"]
    with tempfile.TemporaryDirectory(prefix="pagedllm-dp-bench-") as out_dir:
        for repeat in range(args.repeats):
            order = sizes if repeat % 2 == 0 else sizes[::-1]
            for dp in order:
                threads = max(args.cores // dp, 1)
                print(f"repeat {repeat + 1}/{args.repeats}: D={dp}, {threads} thread(s) each")
                log_path = os.path.join(out_dir, f"serve-{repeat}-{dp}.log")
                with open(log_path, "w") as log, Server(args, dp, threads, log) as server:
                    bench_serve(server.url, args, [*warmup, "--random-range-ratio", "0"], out_dir)
                    for workload in args.workloads:
                        prompts = args.fixed_prompts if workload == "fixed" else args.mixed_prompts
                        flags = [*WORKLOADS[workload], "--num-prompts", str(prompts)]
                        flags += ["--request-rate", str(args.request_rate)]
                        result = bench_serve(server.url, args, flags, out_dir)
                        results[workload][dp].append(result)
                        print(f"  {workload}: {_row(result)}")
    return results


def _row(result: dict) -> str:
    return ", ".join(f"{header} {result[key]:.1f}" for key, header in COLUMNS)


def summarize(results: dict[str, dict[int, list[dict]]]) -> list[str]:
    """A markdown table per workload: the median of each column over the repeats, and each
    setting's ratio to the first."""
    lines = []
    for workload, by_size in results.items():
        header = "| D | " + " | ".join(h for _, h in COLUMNS) + " |"
        lines += [f"{workload}:", "", header, "|---" * (len(COLUMNS) + 1) + "|"]
        medians = {
            dp: [statistics.median(r[key] for r in runs) for key, _ in COLUMNS]
            for dp, runs in by_size.items()
        }
        base_dp, base = next(iter(medians.items()))
        for dp, values in medians.items():
            lines.append(f"| {dp} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
            if dp != base_dp:
                ratios = [v / b if b else float("nan") for v, b in zip(values, base)]
                cells = " | ".join(f"{r:.2f}x" for r in ratios)
                lines.append(f"| {dp} / {base_dp} | {cells} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--data-parallel-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--request-rate", type=float, default=4.0, help="requests/s")
    parser.add_argument("--fixed-prompts", type=int, default=64)
    parser.add_argument("--mixed-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, default=1 << 30, help="KV memory of all engines"
    )
    parser.add_argument(
        "--serve-args", nargs=argparse.REMAINDER, default=[], help="more `serve` flags (last)"
    )
    parser.add_argument("--output-json", default=None, help="write every run's result here")
    args = parser.parse_args(argv)
    results = run(args)
    print("\n".join(summarize(results)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
