"""TTFT of a long shared prefix right after a server restart: the OffloadingConnector's disk
tier vs a cold prefill (BENCHMARKS.md, "Persistent prefix cache").

Each run starts a fresh `pagedllm serve` (a restart), sends one short warm-up request, then
times the first streamed token of one request made of the same `--prefix-len` random tokens
plus `--input-len` fresh ones. Modes alternate run by run: `cold` (no connector), `disk`
(OffloadingConnector on `--disk-path`, filled once by a first server before the runs).

    python scripts/kv_restart_ttft.py --model /tmp/bench/llama-125m --disk-path /tmp/bench/kv
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model, "--port"]
    cmd += [str(port), "--host", "127.0.0.1", "--disable-log-requests", *extra]
    cmd += ["--kv-cache-memory", str(512 << 20)]  # 2,730 blocks: room enough, little RAM
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def ttft(url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"choices"' in line:
                return time.perf_counter() - t0  # the first chunk: the first token
            if line.strip():
                raise RuntimeError(f"unexpected answer: {line[:300]}")
    raise RuntimeError(f"no token streamed (HTTP {r.status_code})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--disk-path", required=True)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 30000, args.prefix_len).tolist()
    prompt = prefix + rng.integers(100, 30000, args.input_len).tolist()
    warmup = rng.integers(100, 30000, 16).tolist()
    kv = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}
    kv["kv_connector_extra_config"]["disk_path"] = args.disk_path
    modes = {"cold": [], "disk": ["--kv-transfer-config", json.dumps(kv)]}

    shutil.rmtree(args.disk_path, ignore_errors=True)
    proc, url = start_server(args.model, modes["disk"])  # fills the disk tier
    ttft(url, prefix + warmup)
    stop_server(proc)

    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for mode, extra in modes.items():
            proc, url = start_server(args.model, extra)
            try:
                ttft(url, warmup)
                results[mode].append(ttft(url, prompt))
            finally:
                stop_server(proc)
            print(mode, f"{results[mode][-1] * 1000:.1f} ms", flush=True)
    medians = {m: statistics.median(v) for m, v in results.items()}
    for mode, values in results.items():
        runs = ", ".join(f"{v * 1000:.1f}" for v in values)
        print(f"{mode}: {runs} ms; median {medians[mode] * 1000:.1f} ms")
    print(f"cold / disk: {medians['cold'] / medians['disk']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": results, "medians": medians}, f, indent=2)
    os.sync()


if __name__ == "__main__":
    main()
