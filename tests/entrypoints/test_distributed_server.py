"""`pagedllm serve` over four worker processes (TP=2 x PP=2): the same greedy completions as
the single-process engine; then a killed worker fails the in-flight stream and turns /health
to 503 within seconds, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.conftest import RemoteServer, cmdline, descendant_pids, pid_alive

pytestmark = pytest.mark.distributed

ARGS = [
    "--dtype", "float32",
    "--max-model-len", "128",
    "--kv-cache-memory-bytes", str(2 << 20),
    "--tensor-parallel-size", "2",
    "-pp", "2",
    "--distributed-executor-backend", "mp",
    "--keep-alive-on-engine-death",  # answer 503 after the worker dies, until SIGTERM
]  # fmt: skip
PROMPTS = [[5, 17, 99, 230, 31, 8, 77], [400, 12, 12, 301, 9], list(range(40, 90))]


def _worker_pids(server_pid: int) -> list[int]:
    """The workers: children of the engine process's fork server."""
    servers = [p for p in descendant_pids(server_pid) if "forkserver" in cmdline(p)]
    return [w for s in servers for w in descendant_pids(s)]


def test_serve_tp2_pp2_identity_and_worker_death(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    reference = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=2 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [
        o.outputs[0].text
        for o in reference.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ]
    reference.shutdown()

    with RemoteServer(tiny_llama_dir, ARGS) as server:
        body = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        for prompt, text in zip(PROMPTS, expected):
            r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        processes = descendant_pids(server.proc.pid)
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 4, [cmdline(p) for p in processes]

        stream_body = {**body, "prompt": PROMPTS[0], "max_tokens": 100, "stream": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=stream_body, timeout=30
        ) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(workers[2], signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
        assert time.monotonic() - t0 < 5
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": PROMPTS[1]})
        assert r.status_code == 503

        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in processes):
            left = [cmdline(p) for p in processes if pid_alive(p)]
            assert time.monotonic() < deadline, f"processes outlived the server: {left}"
            time.sleep(0.1)
