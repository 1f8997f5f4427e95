"""Data parallelism end to end, on real (tiny) engines.

One deployment serves the online tests of this module, so that its processes start once: a
head (`pagedllm serve --data-parallel-size 2 --data-parallel-size-local 1 --api-server-count
2`, running engine 0) and a `--headless` node (`--data-parallel-start-rank 1`, running engine 1)
on loopback. The online tests run in file order; the last two change the deployment (engine 0
killed, then the head stopped). The offline test runs `LLM(data_parallel_size=2,
tensor_parallel_size=2)`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.load_balancer import DPLoadBalancer
from tests.entrypoints.conftest import REPO_ROOT, RemoteServer, child_pids, free_port, pid_alive

pytestmark = pytest.mark.distributed

KV_BYTES = 2 << 20
ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", str(KV_BYTES)]
PROMPTS = [[1, 5 + i % 25, 9, 12 + i // 25] for i in range(50)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[str]:
    """One engine's greedy texts for PROMPTS (fp32, in process)."""
    from pagedllm import LLM, SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=KV_BYTES
        )
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@dataclass
class Deployment:
    head: RemoteServer
    headless: subprocess.Popen


@pytest.fixture(scope="module")
def deployment(tiny_llama_dir):
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    dp += ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama_dir]
    with tempfile.TemporaryFile() as log:
        headless = subprocess.Popen(
            [*cmd, "--headless", "--data-parallel-start-rank", "1", *ARGS, *dp],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            head_args = [*ARGS, *dp, "--api-server-count", "2", "--enable-log-requests"]
            with RemoteServer(tiny_llama_dir, head_args) as head:
                yield Deployment(head, headless)
        finally:
            if headless.poll() is None:
                headless.kill()
                headless.wait()


def _complete(url: str, i: int) -> str:
    body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _burst(url: str, n: int) -> list[str]:
    """n concurrent requests, request i with PROMPTS[i % 50]; their texts in order."""
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda i: _complete(url, i % len(PROMPTS)), range(n)))


def _metric(url: str, name: str) -> dict[str, float]:
    """engine label -> summed value of the samples called `name`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                values[s.labels["engine"]] = values.get(s.labels["engine"], 0) + s.value
    return values


def _descendants(pid: int) -> list[int]:
    children = child_pids(pid)
    return children + [d for child in children for d in _descendants(child)]


def _assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"processes outlived their owner: {pids}"
        time.sleep(0.1)


def test_burst_matches_one_engine_and_splits_evenly(deployment, reference):
    url = deployment.head.url
    before = _metric(url, "vllm:request_success_total")
    texts = _burst(url, 200)
    assert texts == [reference[i % len(PROMPTS)] for i in range(200)]
    after = _metric(url, "vllm:request_success_total")
    split = [after[e] - before.get(e, 0) for e in ("0", "1")]
    # Every request counted once, on the engine that ran it; within 10% of an even split,
    # so both engines' (the head's and the headless node's) outputs were compared above.
    assert sum(split) == 200 and abs(split[0] - split[1]) <= 20, split


def test_prompt_cache_key_keeps_requests_on_its_engine(deployment, reference):
    """Requests sharing a prompt_cache_key go to its home engine (whichever API server takes
    them), so they find their prefix in that engine's cache; outputs are unchanged."""
    url = deployment.head.url
    homes = {DPLoadBalancer(2).home(f"user-{i}"): f"user-{i}" for i in range(20)}
    assert len(homes) == 2  # a key for each engine
    for rank, key in sorted(homes.items()):
        before = _metric(url, "vllm:request_success_total")
        for i in range(10):  # one at a time: never the overflow of a busy home
            body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "prompt_cache_key": key}  # fmt: skip
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference[i]
        after = _metric(url, "vllm:request_success_total")
        on_home = after[str(rank)] - before.get(str(rank), 0)
        # The API servers count their own sends between the coordinator's publishes (every
        # 50 ms); allow one overflow from a publish coming late.
        assert on_home >= 9, (key, rank, on_home)


def test_data_parallel_rank_header_picks_the_engine(deployment, reference):
    """vLLM's X-data-parallel-rank header (an external router's choice) overrides the
    balancer, through completions, chat and Responses alike; bad values are 400s."""
    url = deployment.head.url
    for rank in (1, 0):
        before = _metric(url, "vllm:request_success_total")
        headers = {"X-data-parallel-rank": str(rank)}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # at once: the balancer
            bodies = [{"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True} for i in range(8)]  # fmt: skip
            posts = [pool.submit(httpx.post, f"{url}/v1/completions", json=b, headers=headers,
                                 timeout=120) for b in bodies]  # fmt: skip
            replies = [p.result() for p in posts]
        assert [r.json()["choices"][0]["text"] for r in replies] == reference[:8]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                       headers=headers, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        after = _metric(url, "vllm:request_success_total")
        ran = {e: after[e] - before.get(e, 0) for e in ("0", "1")}
        assert ran == {str(rank): 10, str(1 - rank): 0}, ran
    for bad in ("2", "-1", "one"):
        r = httpx.post(f"{url}/v1/completions", json=bodies[0],
                       headers={"X-data-parallel-rank": bad}, timeout=60)  # fmt: skip
        assert r.status_code == 400 and "X-data-parallel-rank" in r.json()["error"]["message"]


def test_two_api_servers_answer_and_count_once(deployment, reference):
    url = deployment.head.url
    names = ["request_success_total", "prompt_tokens_total", "time_to_first_token_seconds_count"]
    before = [sum(_metric(url, f"vllm:{n}").values()) for n in names]
    assert _burst(url, 40) == [reference[i % len(PROMPTS)] for i in range(40)]
    after = [sum(_metric(url, f"vllm:{n}").values()) for n in names]
    # Counters and histograms add up over the API server processes, each counting its own.
    assert [a - b for a, b in zip(after, before)] == [40, 40 * 4, 40]
    logs = Path(deployment.head.log.name).read_text()
    for index in (0, 1):  # both API servers answered
        assert re.search(rf"APIServer_{index} pid=\d+\] \S+: Finished request", logs)
    # Gauges show the latest value written by either process, not their sum: back to 0.
    deadline = time.monotonic() + 10
    while _metric(url, "vllm:num_requests_running") != {"0": 0.0, "1": 0.0}:
        assert time.monotonic() < deadline, _metric(url, "vllm:num_requests_running")
        time.sleep(0.2)
    assert _metric(url, "vllm:engine_dead") == {"0": 0.0, "1": 0.0}


def test_dashboard_and_health_cover_each_engine(deployment):
    """Whichever API server answers, its dashboard gets both engines' snapshots (the headless
    node's too), and both engines' heartbeats keep them healthy."""
    url = deployment.head.url
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        init = json.loads(next(lines)[6:])
        assert init["config"]["data_parallel_size"] == 2 and len(init["history"]) == 2
        for _ in range(15):
            engines = json.loads(next(lines)[6:])["engines"]
            if all("blocks" in e for e in engines):
                break
        assert [e["health"] for e in engines] == ["ok", "ok"]
        assert all("blocks" in e and e["num_blocks"] > 0 for e in engines), engines
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").json() == {"ready": True}
    assert _metric(url, "vllm:engine_stalled") == {"0": 0.0, "1": 0.0}


def _engine_pid(server: RemoteServer, rank: int) -> int:
    found = re.search(rf"EngineCore_DP{rank} pid=(\d+)", Path(server.log.name).read_text())
    assert found, server.logs()
    return int(found.group(1))


def test_engine_killed_mid_load(deployment, reference):
    """Kill engine 0 (the head's) while six long streams run: its streams end with an error,
    the others finish, and the deployment keeps serving on engine 1."""
    url = deployment.head.url
    body = {"prompt": [1, 2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = threading.Semaphore(0)

    def stream(_: int) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            started.release()
            return [first, *(line for line in lines if line)]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        for _ in range(6):
            assert started.acquire(timeout=60)
        os.kill(_engine_pid(deployment.head, 0), signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
    failed = [r for r in results if any('"error"' in line for line in r)]
    finished = [r for r in results if r not in failed]
    assert failed and finished, results
    assert all("data-parallel engine 0" in "".join(r) for r in failed)
    assert all(r[-1] == "data: [DONE]" for r in results)
    assert all(json.loads(r[-2][6:])["choices"][0]["finish_reason"] == "length" for r in finished)
    for _ in range(4):  # new connections, spread over both API servers
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert list(health.json()["dead_engines"]) == ["0"]
    assert _metric(url, "vllm:engine_dead") == {"0": 1.0, "1": 0.0}
    assert _burst(url, 8) == [reference[i] for i in range(8)]


def test_stopping_the_head_stops_every_node(deployment):
    head, headless = deployment.head, deployment.headless
    processes = child_pids(head.proc.pid) + child_pids(headless.pid)
    head.proc.send_signal(signal.SIGTERM)
    assert head.proc.wait(timeout=60) == 0
    # The head's coordinator told the headless node's engine to stop; the node then exits.
    assert headless.wait(timeout=30) == 0
    _assert_gone(processes)


def test_offline_llm_two_engines_of_two_ranks(tiny_llama_dir, reference):
    """`LLM(data_parallel_size=2, tensor_parallel_size=2)`: two engines, each running its own
    two tensor-parallel workers, give one engine's greedy outputs; with
    `data_parallel_stop_on_engine_death`, one engine's death stops it, and no engine or worker
    outlives it."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.exceptions import EngineDeadError

    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=KV_BYTES,
        data_parallel_size=2,
        tensor_parallel_size=2,
        data_parallel_stop_on_engine_death=True,
    )
    try:
        client = llm.llm_engine.engine_core
        pids = list(client.engine_pids.values())
        workers = [w for pid in pids for w in _descendants(pid)]
        assert len(workers) >= 4, workers  # 2 workers per engine, and their forkservers
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in outputs] == reference
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="data-parallel engine 0"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the death is seen
                llm.generate(prompts[:1], params, use_tqdm=False)
    finally:
        llm.shutdown()
    _assert_gone(pids + workers)
