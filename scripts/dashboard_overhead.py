"""What a watching dashboard costs (against a running `pagedllm serve`): `pagedllm bench serve`
runs alternately with no dashboard listener and with one page's SSE stream open (the engine
then builds a snapshot a second, the front end encodes an update a second), `--runs` times
each; prints each run's output throughput, the medians and their ratio.

    python scripts/dashboard_overhead.py --url http://127.0.0.1:8000 --model DIR --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def listening(url: str, api_key: str | None) -> Iterator[list[int]]:
    """An open /dashboard/events stream, read in a thread; yields [events read]."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stop = threading.Event()
    count = [0]

    def read() -> None:
        with httpx.stream("GET", f"{url}/dashboard/events", headers=headers, timeout=None) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    count[0] += 1
                if stop.is_set():
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join(timeout=5)


def bench(args: argparse.Namespace) -> float:
    """One `pagedllm bench serve` run; its output tokens/s."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve"]
        cmd += ["--base-url", args.url, "--model", args.model, "--tokenizer", args.model]
        cmd += ["--dataset-name", "random", "--num-prompts", str(args.num_prompts)]
        cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        cmd += ["--max-concurrency", str(args.max_concurrency), "--ignore-eos"]
        cmd += ["--disable-tqdm", "--output-json", out.name]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return float(json.load(open(out.name))["output_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True, help="the served model's directory")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    args = parser.parse_args()

    bench(args)  # warm-up, not counted
    without, with_page = [], []
    for run in range(args.runs):
        without.append(bench(args))
        with listening(args.url, args.api_key) as events:
            with_page.append(bench(args))
        assert events[0] > 0, "the dashboard stream sent nothing"
        print(f"run {run}: {without[-1]:.1f} tok/s without, {with_page[-1]:.1f} with a page")
    a, b = statistics.median(without), statistics.median(with_page)
    print(f"median output tok/s: {a:.1f} without a dashboard, {b:.1f} with one listening")
    print(f"ratio (with / without): {b / a:.3f}")


if __name__ == "__main__":
    main()
