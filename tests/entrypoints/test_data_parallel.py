"""Data parallelism end to end: `pagedllm serve --data-parallel-size 2` (greedy outputs as one
engine's, a burst split evenly, one engine killed mid-load), a head plus a `--headless` node on
loopback, and `--api-server-count 2` (both answer, metrics add up)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import REPO_ROOT, RemoteServer, child_pids, free_port, pid_alive

pytestmark = pytest.mark.distributed

ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", str(2 << 20)]
PROMPTS = [[1, 5 + i, 9, 12 + i] for i in range(4)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[str]:
    """One engine's greedy texts (fp32, in process)."""
    from pagedllm import LLM, SamplingParams

    old = os.environ.get("PAGEDLLM_ENABLE_MULTIPROCESSING")
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=2 << 20)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    finally:
        if old is None:
            os.environ.pop("PAGEDLLM_ENABLE_MULTIPROCESSING")
        else:
            os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = old
    return texts


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _burst(url: str, n: int, max_tokens: int = 2) -> None:
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda i: _complete(url, [1, i % 50 + 3], max_tokens), range(n)))


def _metric(url: str, name: str) -> dict[str, float]:
    """engine label -> summed value of the samples called `name`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                values[s.labels["engine"]] = values.get(s.labels["engine"], 0) + s.value
    return values


def _assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"processes outlived their owner: {pids}"
        time.sleep(0.1)


def _engine_pid(server: RemoteServer, rank: int) -> int:
    found = re.search(rf"EngineCore_DP{rank} pid=(\d+)", Path(server.log.name).read_text())
    assert found, server.logs()
    return int(found.group(1))


def test_two_engines_identity_balance_and_fault(tiny_llama_dir, reference):
    args = [*ARGS, "--data-parallel-size", "2", "--max-model-len", "512"]
    with RemoteServer(tiny_llama_dir, args) as server:
        assert [_complete(server.url, p) for p in PROMPTS] == reference
        before = _metric(server.url, "pagedllm:request_success_total")
        _burst(server.url, 200)
        after = _metric(server.url, "pagedllm:request_success_total")
        split = [after[e] - before.get(e, 0) for e in ("0", "1")]
        assert sum(split) == 200 and abs(split[0] - split[1]) <= 20, split

        # Kill engine 1 while six long streams run: its streams end with an error, the
        # others finish, and the server keeps serving on engine 0.
        body = {"prompt": [1, 2], "max_tokens": 400, "ignore_eos": True, "stream": True}
        started = threading.Semaphore(0)

        def stream(_: int) -> list[str]:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(lines)
                started.release()
                return [first, *(line for line in lines if line)]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream, i) for i in range(6)]
            for _ in range(6):
                assert started.acquire(timeout=60)
            os.kill(_engine_pid(server, 1), signal.SIGKILL)
            results = [f.result(timeout=60) for f in futures]
        failed = [r for r in results if any('"error"' in line for line in r)]
        finished = [r for r in results if r not in failed]
        assert failed and finished, results
        assert all("data-parallel engine 1" in "".join(r) for r in failed)
        assert all(r[-1] == "data: [DONE]" for r in results)
        assert all(
            json.loads(r[-2][6:])["choices"][0]["finish_reason"] == "length" for r in finished
        )
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert list(health.json()["dead_engines"]) == ["1"]
        assert _metric(server.url, "pagedllm:engine_dead") == {"0": 0.0, "1": 1.0}
        assert [_complete(server.url, p) for p in PROMPTS] == reference


def test_head_and_headless_node_on_loopback(tiny_llama_dir, reference):
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    dp += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama_dir]
    headless = subprocess.Popen(
        [*cmd, "--headless", "--data-parallel-start-rank", "1", *ARGS, *dp],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with RemoteServer(tiny_llama_dir, [*ARGS, *dp]) as server:
            texts = [_complete(server.url, p) for p in PROMPTS]
            _burst(server.url, 8)
            served = _metric(server.url, "pagedllm:request_success_total")
            remote_engines = child_pids(headless.pid)
        assert texts == reference
        assert served["1"] > 0  # the headless node's engine took requests
        # The head stopped: its coordinator told the headless node's engine to stop too.
        assert headless.wait(timeout=30) == 0
        _assert_gone(remote_engines)
    finally:
        if headless.poll() is None:
            headless.kill()
            headless.wait()


def test_two_api_servers_share_the_port_and_the_metrics(tiny_llama_dir, reference):
    args = [*ARGS, "--data-parallel-size", "2", "--api-server-count", "2"]
    with RemoteServer(tiny_llama_dir, args) as server:
        assert [_complete(server.url, p) for p in PROMPTS] == reference
        _burst(server.url, 60)
        logs = Path(server.log.name).read_text()
        for index in (0, 1):  # both API servers answered
            assert re.search(rf"APIServer_{index} pid=\d+\] \S+: Finished request", logs)
        done = sum(_metric(server.url, "pagedllm:request_success_total").values())
        assert done == 64  # counted once each, whichever API server scrapes
        prompt_tokens = sum(_metric(server.url, "pagedllm:prompt_tokens_total").values())
        assert prompt_tokens == 4 * 4 + 60 * 2
        server_pid = server.proc.pid
        children = child_pids(server_pid)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
    _assert_gone(children)
