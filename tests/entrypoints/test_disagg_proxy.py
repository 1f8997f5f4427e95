"""`pagedllm disagg-proxy` in front of a prefill and a decode server (P2pZmqConnector), all
live processes: completions (plain and streamed) and chat through the proxy equal one engine's
fp32 greedy output, with prefix caching and chunked prefill on and a decode pool small enough to
preempt when the requests overlap (whether they do depends on the machine's timing;
test_p2p_zmq_connector.py shows preemption with this connector deterministically); every KV
block comes back to the pool on both sides; blocks nobody pulls are freed after the timeout;
killing the prefill server makes the decode server recompute and the proxy report the dead
backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.distributed.kv_transfer.conftest import make_prompts
from tests.entrypoints.conftest import REPO_ROOT, RemoteServer, child_pids, free_port

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "32"]
PREFILL_KV = {
    "kv_connector": "P2pZmqConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {"abort_request_timeout": 5},
}
DECODE_KV = {
    "kv_connector": "P2pZmqConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {"transfer_timeout": 20},
}
MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "Tell me about the weather in the mountains today."}]


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


class Proxy:
    """`pagedllm disagg-proxy` on a free port, stopped on exit."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-proxy-", suffix=".log")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "disagg-proxy"]
        cmd += ["--prefill", prefill, "--decode", decode, "--port", self.url.rsplit(":", 1)[1]]
        cmd += ["--health-check-interval", "0.5"]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=self.log)
        ready = wait_for(lambda: self._get("/health") == 200, 60)
        assert ready, Path(self.log.name).read_text()

    def _get(self, path: str) -> int | None:
        try:
            return httpx.get(self.url + path, timeout=2).status_code
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from pagedllm import LLM, SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        texts = [
            o.outputs[0].text
            for o in llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
        ]
        chat = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
        llm.shutdown()
    return texts, chat


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    specs = [
        ENGINE
        + ["--num-gpu-blocks-override", "64", "--kv-transfer-config", json.dumps(PREFILL_KV)],
        ENGINE
        + ["--num-gpu-blocks-override", "12", "--max-num-seqs", "4"]
        + ["--kv-transfer-config", json.dumps(DECODE_KV)],
    ]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(RemoteServer, tiny_llama_dir, args) for args in specs]
        started = [f.result() for f in futures]
    prefill, decode = started
    proxy = Proxy(prefill.url, decode.url)
    yield prefill, decode, proxy
    proxy.stop()
    for server in started:
        server.stop()


def completion(url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_through_the_proxy(servers, reference):
    prefill, decode, proxy = servers
    texts, chat_text = reference
    prompts = make_prompts()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: completion(proxy.url, p), prompts))
    assert [r["choices"][0]["text"] for r in results] == texts

    body = {"prompt": prompts[1], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == texts[1]

    chat = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == chat_text

    bad = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": [1], "n": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"

    for server in (prefill, decode):  # every block back in the pool, on both sides
        assert wait_for(lambda s=server: metric(s, "vllm:kv_cache_usage_perc") == 0.0)
    assert "were not pulled" not in prefill.logs()  # released by the pulls, not the timeout
    assert "KV transfer for request" not in decode.logs()


def test_faults(servers, reference):
    prefill, decode, proxy = servers
    texts, _ = reference
    prompt = make_prompts()[0]
    kv_params = {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
    # Nobody pulls: the prefill side frees the blocks after abort_request_timeout (5 s).
    completion(prefill.url, prompt, **kv_params)
    assert metric(prefill, "vllm:kv_cache_usage_perc") > 0
    assert wait_for(lambda: metric(prefill, "vllm:kv_cache_usage_perc") == 0.0)
    assert "were not pulled within 5s" in prefill.logs()

    # The prefill instance dies after handing out its kv_transfer_params.
    params = completion(prefill.url, prompt, **kv_params)["kv_transfer_params"]
    for pid in [*child_pids(prefill.proc.pid), prefill.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    result = completion(decode.url, prompt, kv_transfer_params=params)
    assert result["choices"][0]["text"] == texts[0]  # recomputed on the decode side
    assert "KV transfer for request" in decode.logs() and "refused" in decode.logs()
    assert wait_for(lambda: metric(decode, "vllm:kv_cache_usage_perc") == 0.0)

    # The proxy reports the dead backend, and a request gets a clear error naming it.
    def prefill_down() -> bool:
        return httpx.get(f"{proxy.url}/health", timeout=5).status_code == 503

    assert wait_for(prefill_down)
    health = httpx.get(f"{proxy.url}/health", timeout=5).json()
    assert health["prefill"][0]["healthy"] is False and health["decode"][0]["healthy"] is True
    r = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == 503 and prefill.url in r.json()["error"]["message"]
