"""The OpenAI-compatible server end to end, through the official `openai` client (sync and
async) against one live `pagedllm serve` (tiny Llama, fp32, API key on) for the module."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer

MODEL = "tiny"
MAX_MODEL_LEN = 256
SERVER_ARGS = [
    "--served-model-name", MODEL,
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "64",
    "--kv-cache-memory", str(4 << 20),
    "--api-key", API_KEY,
    "--seed", "0",
    "--enable-log-requests",
    "--enable-prompt-tokens-details",
]  # fmt: skip
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _tokens(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0] if "finished_reason" not in name else name] = float(value)
    return values


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_and_usage(server, client):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(_tokens(server, prompt))
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    # Greedy is deterministic, and a stream carries the same text and usage.
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    assert again.choices[0].text == choice.text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_prompt_tokens_details_report_prefix_cache_hits(server, client):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is the
    prompt tokens served from the prefix cache (whole 16-token blocks), in chat and
    completions, plain and streamed (the final usage chunk)."""
    words = " ".join(f"w{random.randrange(10**6)}" for _ in range(12))  # unseen: 0 cached
    prompt = f"Details {words}"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n_prompt = first.usage.prompt_tokens
    assert n_prompt >= 48
    full_blocks = (n_prompt - 1) // 16 * 16  # the last token is always computed
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == full_blocks

    messages = [{"role": "user", "content": f"Chat {words}"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    n_chat = chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens == (n_chat - 1) // 16 * 16 > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n_chat - 1) // 16 * 16


def test_completion_prompt_forms_echo_and_n(server, client):
    ids = _tokens(server, "Hello there")
    out = client.completions.create(
        model=MODEL, prompt=["Hello there", "Good morning"], max_tokens=3, n=2, **GREEDY
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, **GREEDY)
    by_text = [c.text for c in out.choices if c.index == 0][0]
    assert by_ids.choices[0].text == by_text
    batch = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, **GREEDY)
    assert [c.text for c in batch.choices] == [by_text, by_text]
    echoed = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, echo=True, **GREEDY
    )
    assert echoed.choices[0].text == "Hello there" + by_text


def test_completion_logprobs_and_sampling_n(client):
    out = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, n=3, temperature=1.0, seed=7,
        logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(out.choices) == 3
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(x <= 0.0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        assert all(isinstance(t, str) for t in lp.tokens)
        assert lp.text_offset == sorted(lp.text_offset)


def test_completion_prompt_logprobs(server, client):
    ids = _tokens(server, "Once upon a time")
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0.0,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
    )  # fmt: skip
    prompt_logprobs = out.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token, entry in zip(ids[1:], prompt_logprobs[1:]):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0.0


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=12, **GREEDY)
    text = full.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy text {text!r} has no usable stop string")
    out = client.completions.create(
        model=MODEL, prompt="Tell me", max_tokens=12, stop=[stop], **GREEDY
    )
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 12
    kept = client.completions.create(
        model=MODEL,
        prompt="Tell me",
        max_tokens=12,
        stop=[stop],
        temperature=0.0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_chat_async_stream_and_logprobs(async_client):
    messages = [{"role": "user", "content": "Say something nice."}]

    async def run():
        full = await async_client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=8, logprobs=True,
            top_logprobs=2, **GREEDY,
        )  # fmt: skip
        choice = full.choices[0]
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert full.usage.completion_tokens == 8
        assert len(choice.logprobs.content) == 8
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == 8
        n2 = await async_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, n=2, temperature=1.0, seed=3
        )
        assert sorted(c.index for c in n2.choices) == [0, 1]

    asyncio.run(run())


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert "Hello world" in d["prompt"]
    chat = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["count"] > 1


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": 42}, 400, "prompt"),
        ({"prompt": [1] * (MAX_MODEL_LEN + 5)}, 400, f"maximum context length is {MAX_MODEL_LEN}"),
        ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "maximum context length"),
        ({"prompt": "hi", "model": "gpt-17"}, 404, "gpt-17"),
    ],
)
def test_bad_requests_then_good(server, client, body, status, needle):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, **body}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]
    ok = client.completions.create(model=MODEL, prompt="fine", max_tokens=2, **GREEDY)
    assert ok.usage.completion_tokens == 2


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # not under /v1


def test_64_concurrent_greedy_match_alone_and_offline(server, tiny_llama_dir, async_client):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))] for _ in range(64)]
    max_tokens = 6

    async def one(ids):
        out = await async_client.completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, **GREEDY
        )
        return out.choices[0].text

    async def run():
        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts[:16]]
        return together, alone

    together, alone = asyncio.run(run())
    assert alone == together[:16]

    from pagedllm import LLM, SamplingParams

    llm = LLM(
        model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=4 << 20
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].text for o in offline] == together


def test_abandoned_stream_frees_blocks(server):
    body = {
        "model": MODEL,
        "prompt": "A long story:",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert all(json.loads(g[6:])["choices"] for g in got if g.startswith("data: {"))
    # The connection is closed mid-stream: the request must be aborted and its blocks freed.
    deadline = time.monotonic() + 20
    while True:
        m = _metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["vllm:generation_tokens_total"] > 0
    assert m["vllm:prompt_tokens_total"] > 0
    assert m["vllm:time_to_first_token_seconds_count"] > 0
    assert "vllm:e2e_request_latency_seconds_count" in m
    # It was aborted (not run to its 200 tokens), and the server logged it.
    assert "Aborted request cmpl-" in server.logs()


def test_log_lines(server, client):
    client.completions.create(model=MODEL, prompt="log me", max_tokens=2, **GREEDY)
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.logs():
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.2)
    logs = server.logs()
    assert "Finished request cmpl-" in logs and "output_tokens=2" in logs
    assert "KV cache usage" in logs and "Prefix cache hit rate" in logs
