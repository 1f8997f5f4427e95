"""Decode inter-token latency while long prefills arrive: disaggregated prefill/decode
(1 prefill + 1 decode instance, one core each, behind `pagedllm disagg-proxy`) vs one
instance with two threads (BENCHMARKS.md, "Disaggregated prefill/decode").

Two `pagedllm bench serve` clients run at once against the endpoint: the measured one streams
decode-heavy requests (short prompts, long outputs); the other sends long prompts at a steady
rate. The measured client's ITL percentiles are the figures. Modes alternate run by run.

    python scripts/disagg_itl.py --model /tmp/bench/llama-125m --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from pagedllm.benchmarks import server_process

P2P = {"kv_connector": "P2pZmqConnector"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], cores: str | None, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str) -> None:
    server_process.wait_healthy(url, None, 300)


def serve(model: str, cores: str | None, threads: int, kv_role: str | None):
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-log-requests"]
    cmd += ["--kv-cache-memory", str(512 << 20)]
    if kv_role is not None:
        cmd += ["--kv-transfer-config", json.dumps({**P2P, "kv_role": kv_role})]
    return launch(cmd, cores, threads), f"http://127.0.0.1:{port}"


def start(mode: str, model: str) -> tuple[list[subprocess.Popen], str]:
    if mode == "single":
        proc, url = serve(model, "0,1", 2, None)
        wait_healthy(url)
        return [proc], url
    prefill, prefill_url = serve(model, "0", 1, "kv_producer")
    decode, decode_url = serve(model, "1", 1, "kv_consumer")
    wait_healthy(prefill_url)
    wait_healthy(decode_url)
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "disagg-proxy", "--port"]
    cmd += [str(port), "--prefill", prefill_url, "--decode", decode_url]
    proxy = launch(cmd, None, 1)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return [prefill, decode, proxy], url


def bench(url: str, model: str, extra: list[str], out: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve"]
    cmd += ["--base-url", url, "--model", model, "--dataset-name", "random", "--ignore-eos"]
    cmd += ["--random-range-ratio", "0", "--disable-tqdm", "--output-json", out, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_once(mode: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    procs, url = start(mode, model)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            decode_json, prefill_json = f"{tmp}/decode.json", f"{tmp}/prefill.json"
            decodes = bench(
                url,
                model,
                ["--input-len", "64", "--output-len", str(args.decode_output_len)]
                + ["--num-prompts", "8", "--max-concurrency", "4"]
                + ["--percentile-metrics", "itl,ttft", "--metric-percentiles", "50,99"],
                decode_json,
            )
            time.sleep(2.0)  # decodes under way before the long prompts come
            prefills = bench(
                url,
                model,
                ["--input-len", str(args.prefill_len), "--output-len", "4"]
                + ["--num-prompts", str(args.num_prefills), "--request-rate", str(args.rate)]
                + ["--seed", "1"],
                prefill_json,
            )
            decodes.wait()
            prefills.wait()
            with open(decode_json) as f:
                result = json.load(f)
            with open(prefill_json) as f:
                long_ttft = json.load(f)["median_ttft_ms"]
        return {
            "p50_itl_ms": result["p50_itl_ms"],
            "p99_itl_ms": result["p99_itl_ms"],
            "long_prompt_median_ttft_ms": long_ttft,
        }
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--num-prefills", type=int, default=6)
    parser.add_argument("--rate", type=float, default=0.5, help="long prompts per second")
    parser.add_argument("--decode-output-len", type=int, default=192)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"single": [], "disagg": []}
    for _ in range(args.runs):
        for mode in results:
            results[mode].append(run_once(mode, args.model, args))
            print(mode, results[mode][-1], flush=True)
    for mode, runs in results.items():
        p99 = [r["p99_itl_ms"] for r in runs]
        print(
            f"{mode}: p99 ITL {', '.join(f'{v:.1f}' for v in p99)} ms; "
            f"median {statistics.median(p99):.1f} ms"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
