"""What real clients send and receive, against one live `pagedllm serve` (tiny Llama, fp32):
every streamed chunk validates as the official SDK's type in strict mode, lm-eval-style
prompt scoring (`echo` + `max_tokens=0` + `logprobs`) matches transformers, vLLM's extra
fields act (beam search, allowed_token_ids, bad_words, chat prompt_logprobs / echo,
truncate_prompt_tokens, return_tokens_as_token_ids, cache_salt), and a field pagedllm would
not honour is a 400 naming it (request_checks.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from tests.entrypoints.conftest import API_KEY, RemoteServer

MODEL = "tiny"
MODEL_NAMES = [MODEL, "second-name"]
# Most flags come from a YAML file (--config); the command line adds the API key.
SERVER_CONFIG = f"""
served-model-name: {MODEL_NAMES}
dtype: float32
max-model-len: 256
kv-cache-memory-bytes: 4M
seed: 0
max-logprobs: 3
enable-log-requests: true
allowed-origins: ["http://allowed.example"]
allowed-methods: ["POST"]
"""
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "serve.yaml"
    path.write_text(SERVER_CONFIG)
    with RemoteServer(tiny_llama_dir, ["--config", str(path), "--api-key", API_KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers=HEADERS)


def _stream(server, path: str, body: dict) -> list[dict]:
    """The raw JSON of every `data:` event of a streamed response, up to [DONE]."""
    events = []
    body = {"model": MODEL, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return events
                events.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def _tokenize(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]


def _detokenize(server, ids: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]


def _validate_completion_chunk(chunk: dict) -> None:
    """`Completion` in strict mode. The SDK's type (shared with whole responses) requires a
    finish reason; a stream, OpenAI's own included, sends null until a choice ends: that is
    the only error allowed, and only where the finish reason is null."""
    try:
        Completion.model_validate(chunk, strict=True)
    except pydantic.ValidationError as e:
        for err in e.errors():
            loc = err["loc"]
            assert loc[0] == "choices" and loc[2:] == ("finish_reason",), err
            assert chunk["choices"][loc[1]]["finish_reason"] is None, err


def test_stream_chunks_validate_strictly(server):
    chat = _stream(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True},
            "temperature": 0.0,
        },
    )  # fmt: skip
    num_tokens = {0: 0, 1: 0}
    for chunk in chat:
        assert chunk["object"] == "chat.completion.chunk"
        ChatCompletionChunk.model_validate(chunk, strict=True)
        for choice in chunk["choices"]:
            num_tokens[choice["index"]] += len((choice.get("logprobs") or {}).get("content", []))
    assert num_tokens == {0: 5, 1: 5}
    assert chat[-1]["choices"] == [] and chat[-1]["usage"]["completion_tokens"] == 10

    completion = _stream(
        server,
        "/v1/completions",
        {
            "prompt": ["Once upon", "A time"], "max_tokens": 4, "logprobs": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "temperature": 0.0,
        },
    )  # fmt: skip
    for chunk in completion:
        assert chunk["object"] == "text_completion"
        _validate_completion_chunk(chunk)
        for choice in chunk["choices"]:
            lp = choice["logprobs"]
            assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) >= 1
    # text_offset runs on across the chunks of one choice.
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in completion if c["choices"]
               and c["choices"][0]["index"] == 0]  # fmt: skip
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo_scoring_matches_transformers(server, client, tiny_llama_dir):
    """lm-eval's loglikelihood: score context + continuation without generating."""
    from transformers import AutoModelForCausalLM

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The cat sat on the mat"}).json()
    ids = ids["tokens"]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0.0
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert out.usage.completion_tokens == 0 and choice.text == "".join(lp.tokens)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
    greedy = logits[:-1].argmax(-1).tolist()
    for pos, top in enumerate(lp.top_logprobs[1:]):  # lm-eval's is_greedy test
        assert (max(top.values()) == lp.token_logprobs[pos + 1]) == (greedy[pos] == ids[pos + 1])
    # The text form scores the same, and a plain max_tokens=0 is refused.
    text = client.completions.create(
        model=MODEL, prompt="The cat sat on the mat", max_tokens=0, echo=True, logprobs=1
    )
    assert text.choices[0].logprobs.token_logprobs == lp.token_logprobs
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_token_filters_act(server, client):
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0}
    allowed = [40, 41, 42]
    out = client.completions.create(
        **base, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    tokens = out.choices[0].logprobs.tokens
    assert tokens and all(t.startswith("token_id:") and int(t[9:]) in allowed for t in tokens)
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    plain = client.completions.create(**base, logprobs=0, extra_body=as_ids)
    plain_ids = [int(t[9:]) for t in plain.choices[0].logprobs.tokens]
    # A generated token that is a word on its own: bad_words bans it (as its own sequence).
    token, word = next(
        (t, w.strip())
        for t in plain_ids
        if (w := _detokenize(server, [t])).strip().isalpha()
        and _tokenize(server, w.strip()) in ([t], _tokenize(server, " " + w.strip()))
        and t in (_tokenize(server, w.strip()) + _tokenize(server, " " + w.strip()))
    )
    banned = client.completions.create(
        **base, logprobs=0, extra_body={"bad_words": [word], **as_ids}
    )
    banned_ids = [int(t[9:]) for t in banned.choices[0].logprobs.tokens]
    assert token in plain_ids and token not in banned_ids
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True,
        temperature=0.0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(int(t.token[9:]) in allowed for t in content)


def test_chat_prompt_logprobs_echo_and_truncation(server, client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0.0,
        extra_body={"prompt_logprobs": 1, "echo": True, **body},
    )  # fmt: skip
    prompt_logprobs = out.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == out.usage.prompt_tokens and prompt_logprobs[0] is None
    assert all(
        entry and all(v["logprob"] <= 0 for v in entry.values()) for entry in prompt_logprobs[1:]
    )
    assert out.choices[0].message.content.startswith("Well,")
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0.0, extra_body=body
    )
    assert out.choices[0].message.content == "Well," + plain.choices[0].message.content
    short = client.completions.create(
        model=MODEL, prompt="one two three four five six", max_tokens=2,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert short.usage.prompt_tokens == 3


def test_beam_search_over_http(server, client, tiny_llama_dir, monkeypatch):
    from pagedllm import LLM, BeamSearchParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # the offline reference

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The capital of"}).json()
    ids = ids["tokens"]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, n=2, temperature=0.0, logprobs=1,
        extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.8,
                    "ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.8, ignore_eos=True)
        offline = llm.beam_search([{"prompt_token_ids": ids}], params)[0].sequences
    finally:
        llm.shutdown()
    assert len(out.choices) == 2
    for choice, seq in zip(out.choices, offline[:2]):
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in seq.tokens[len(ids) :]]
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(seq.cum_logprob, abs=1e-4)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    chunks = _stream(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
         "temperature": 0.0, "use_beam_search": True},
    )  # fmt: skip
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk, strict=True)
    finished = [c["choices"][0] for c in chunks if c["choices"][0].get("finish_reason")]
    assert sorted(c["index"] for c in finished) == [0, 1]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "top_p": 0.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
        ("/v1/completions", {"prompt": "x", "logits_processors": ["m.P"]}, "logits_processors"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": True},
         "store"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "web_search_options": {}}, "web_search_options"),
        ("/tokenize", {"prompt": "x", "return_tokens": True}, "return_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": True,
                             "stream_options": {"include_usage": True, "verbose": 1}},
         "stream_options.verbose"),
    ],
)  # fmt: skip
def test_fields_that_would_not_act_are_400(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_fields_holding_what_pagedllm_does_are_accepted(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, store=False,
        modalities=["text"], service_tier="auto", user="u1", prompt_cache_key="conversation-1",
    )  # fmt: skip
    assert out.usage.completion_tokens == 1


def test_cache_salt_separates_prefix_caches(server, client):
    def hits() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total{")
        )

    prompt = "lorem ipsum dolor sit amet " * 12

    def run(salt: str | None) -> float:
        before = hits()
        extra = {"cache_salt": salt} if salt else {}
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return hits() - before

    run("alpha")
    assert run("alpha") > 0  # same namespace: the prefix is cached
    assert run("beta") == 0  # another namespace sees none of it
    assert run(None) == 0
    r = _post(server, "/v1/completions", {"prompt": "x", "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]


def test_metrics_carry_vllm_names_and_phases(server, client):
    client.completions.create(model=MODEL, prompt="Once", max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and 'model_name="tiny"' in line and "_bucket" not in line:
            values[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    for name in (
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_params_n_count",
        "vllm:request_params_max_tokens_count",
        "vllm:iteration_tokens_total_count",
    ):
        assert values[name] >= 1, name
    assert values["vllm:request_decode_time_seconds_sum"] > 0
    assert "vllm:cache_config_info{" in text and "pagedllm:" not in text


def test_served_names_max_logprobs_and_request_log(server):
    url = server.url
    models = httpx.get(f"{url}/v1/models", headers=HEADERS).json()["data"]
    assert [m["id"] for m in models] == MODEL_NAMES
    body = {"prompt": "hi", "max_tokens": 2, "user": "user-7", "logprobs": 3}
    for name in MODEL_NAMES:
        r = httpx.post(f"{url}/v1/completions", json={"model": name, **body}, headers=HEADERS)
        assert r.status_code == 200 and r.json()["model"] == MODEL
    r = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 4}, headers=HEADERS)
    assert r.status_code == 400 and "max-logprobs" in r.json()["error"]["message"]
    logs = server.logs()
    assert "Received request cmpl-" in logs and "user=user-7" in logs


def test_cors(server):
    preflight = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(
        f"{server.url}/v1/completions",
        headers={"Origin": "http://allowed.example", **preflight},
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://allowed.example"
    refused = httpx.options(
        f"{server.url}/v1/completions",
        headers={"Origin": "http://other.example", **preflight},
    )
    assert "access-control-allow-origin" not in refused.headers


def test_reset_prefix_cache(server):
    url = server.url

    def hits() -> float:
        lines = httpx.get(f"{url}/metrics").text.splitlines()
        return sum(
            float(x.rsplit(" ", 1)[1])
            for x in lines
            if x.startswith("vllm:prefix_cache_hits_total{")
        )

    prompt = {"prompt": "a b c d e f g h " * 8, "max_tokens": 1}
    _post(server, "/v1/completions", prompt)
    before = hits()
    _post(server, "/v1/completions", prompt)
    assert hits() > before  # cached
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
    before = hits()
    _post(server, "/v1/completions", prompt)
    assert hits() == before  # forgotten
