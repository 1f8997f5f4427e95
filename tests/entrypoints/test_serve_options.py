"""vLLM's server-wide `serve` flags, against one live server that sets them all, and one
that sets none for the defaults: --response-role, --default-chat-template-kwargs,
--return-tokens-as-token-ids, --enable-force-include-usage, --enable-request-id-headers,
--disable-fastapi-docs, --disable-uvicorn-access-log."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer

MODEL = "tiny"
COMMON = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
          "--kv-cache-memory", str(4 << 20)]  # fmt: skip
OPTIONS = [
    "--response-role", "bot",
    "--default-chat-template-kwargs", '{"enable_thinking": false}',
    "--return-tokens-as-token-ids",
    "--enable-force-include-usage",
    "--enable-request-id-headers",
    "--disable-fastapi-docs",
    "--disable-uvicorn-access-log",
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    with (
        RemoteServer(tiny_llama_dir, COMMON + OPTIONS) as set_,
        RemoteServer(tiny_llama_dir, COMMON) as plain,
    ):
        yield set_, plain


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _stream_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_response_role(servers):
    set_, plain = servers
    assert _chat(set_.url).json()["choices"][0]["message"]["role"] == "bot"
    assert _chat(plain.url).json()["choices"][0]["message"]["role"] == "assistant"
    chunks = _stream_events(set_.url, "/v1/chat/completions",
                            {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                             "stream": True})  # fmt: skip
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    # A continued final message keeps that message's role (vLLM's rule).
    cont = MESSAGES + [{"role": "assistant", "content": "Well"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    reply = _chat(set_.url, messages=cont, **body).json()
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_default_chat_template_kwargs_under_the_requests_own(servers):
    """The demo template closes an empty think block with enable_thinking=false: the server's
    default renders it, a request's own kwargs win over the default."""
    set_, plain = servers

    def prompt_tokens(url: str, kwargs: dict | None) -> int:
        extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
        return _chat(url, **extra).json()["usage"]["prompt_tokens"]

    off = prompt_tokens(plain.url, {"enable_thinking": False})
    on = prompt_tokens(plain.url, None)
    assert off != on
    assert prompt_tokens(set_.url, None) == off
    assert prompt_tokens(set_.url, {"enable_thinking": True}) == on


def test_tokens_as_token_ids_by_default_request_overrides(servers):
    set_, _ = servers
    lp = _chat(set_.url, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert all(t["token"].startswith("token_id:") for t in lp)
    body = {"logprobs": True, "return_tokens_as_token_ids": False}
    lp = _chat(set_.url, **body).json()["choices"][0]["logprobs"]["content"]
    assert not any(t["token"].startswith("token_id:") for t in lp)


def test_force_include_usage_ends_every_stream_with_usage(servers):
    set_, plain = servers
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "Once upon"}),
    ):
        body = {"model": MODEL, "max_tokens": 3, "stream": True, **body}
        events = _stream_events(set_.url, path, body)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        assert all("usage" not in e for e in _stream_events(plain.url, path, body))


def test_request_id_headers(servers):
    set_, plain = servers
    given = httpx.post(
        f"{set_.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
        headers={"X-Request-Id": "mine-1"},
    )
    assert given.headers["x-request-id"] == "mine-1"
    assert given.json()["id"].endswith("mine-1")  # the request's own id
    fresh = _chat(set_.url)
    assert len(fresh.headers["x-request-id"]) == 32
    assert fresh.json()["id"].endswith(fresh.headers["x-request-id"])
    assert httpx.get(f"{set_.url}/nowhere").headers.get("x-request-id")  # errors too
    assert "x-request-id" not in _chat(plain.url).headers


def test_docs_off_and_access_log_off(servers):
    set_, plain = servers
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{set_.url}{path}").status_code == 404
    assert httpx.get(f"{plain.url}/openapi.json").status_code == 200
    httpx.get(f"{set_.url}/v1/models")
    httpx.get(f"{plain.url}/v1/models")
    assert '"GET /v1/models HTTP/1.1" 200' in plain.logs()
    assert '"GET /v1/models HTTP/1.1"' not in set_.logs()
