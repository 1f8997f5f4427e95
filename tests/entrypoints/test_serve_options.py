"""vLLM's server-wide `serve` flags, against one live server that sets them all, and one
that sets none for the defaults: --response-role, --default-chat-template-kwargs,
--return-tokens-as-token-ids, --enable-force-include-usage, --enable-request-id-headers,
--disable-fastapi-docs, --disable-uvicorn-access-log, --trust-request-chat-template,
--exclude-tools-when-tool-choice-none, --enable-log-outputs and --max-log-len."""

from __future__ import annotations

import ast
import json
import re
import tempfile
from pathlib import Path

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
    "--trust-request-chat-template",
    "--exclude-tools-when-tool-choice-none",
    "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "5",
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    with (
        RemoteServer(
            tiny_llama_dir, COMMON + OPTIONS, env={"PAGEDLLM_LOGGING_LEVEL": "DEBUG"}
        ) as set_,
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


def test_a_requests_chat_template_needs_trust(servers):
    set_, plain = servers
    template = "{{ 'Hello' }}"
    for extra in (
        {"chat_template": template},
        {"chat_template_kwargs": {"chat_template": template}},
    ):
        r = _chat(plain.url, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    r = httpx.post(f"{plain.url}/tokenize", json={"messages": MESSAGES, "chat_template": template})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.text
    trusted = httpx.post(
        f"{set_.url}/tokenize", json={"messages": MESSAGES, "chat_template": template}
    )
    assert trusted.status_code == 200, trusted.text
    hello = httpx.post(
        f"{set_.url}/tokenize", json={"prompt": "Hello", "add_special_tokens": False}
    ).json()["tokens"]
    assert trusted.json()["tokens"] == hello  # the request's template, not the model's
    assert _chat(set_.url, chat_template=template).json()["usage"]["prompt_tokens"] == len(hello)


def test_tools_left_out_of_the_prompt_for_tool_choice_none(servers):
    set_, plain = servers

    def prompt_tokens(url: str, **extra) -> int:
        return _chat(url, **extra).json()["usage"]["prompt_tokens"]

    bare = prompt_tokens(plain.url)
    assert prompt_tokens(plain.url, tools=TOOLS, tool_choice="none") > bare
    bare = prompt_tokens(set_.url)  # (its default kwargs render a closed think block)
    assert prompt_tokens(set_.url, tools=TOOLS, tool_choice="none") == bare
    assert prompt_tokens(set_.url, tools=TOOLS, tool_choice="required") > bare


def test_log_outputs_cut_to_max_log_len(servers):
    set_, plain = servers
    reply = _chat(set_.url, max_tokens=8).json()
    streamed = _stream_events(
        set_.url, "/v1/completions",
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True},
    )  # fmt: skip
    text = "".join(e["choices"][0]["text"] for e in streamed if e["choices"])
    logs = Path(set_.log.name).read_text(errors="replace")

    def logged(pattern: str) -> re.Match:
        match = re.search(pattern, logs, re.MULTILINE)
        assert match, pattern
        return match

    for request_id, full in (
        (reply["id"], reply["choices"][0]["message"]["content"]),
        (streamed[0]["id"] + "-0", text),
    ):  # fmt: skip (prompt 0)
        rid = re.escape(request_id)
        output = logged(
            rf"Generated response {rid} \(choice 0\): output: (.*), finish_reason: length$"
        )
        assert ast.literal_eval(output.group(1)) == full[:5], output.group(0)
        ids = logged(rf"Generated response {rid} \(choice 0\) details: output_token_ids: \[(.*)\]$")
        assert len(ids.group(1).split(",")) == 5, ids.group(0)
    details = logged(
        rf"Request {re.escape(streamed[0]['id'])}-0 details: prompt: (.*), prompt_token_ids"
    )
    assert ast.literal_eval(details.group(1)) == "Once ", details.group(0)
    assert "Generated response" not in Path(plain.log.name).read_text(errors="replace")


def test_the_servers_chat_template_renders_every_chat_endpoint(tiny_llama_dir):
    """--chat-template (a file) is what chat completions, the Responses API and /tokenize
    render with; a request's own template is still refused without trust."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as f:
        f.write(template)
        f.flush()
        with RemoteServer(tiny_llama_dir, COMMON + ["--chat-template", f.name]) as server:
            url = server.url
            expected = httpx.post(
                f"{url}/tokenize",
                json={"prompt": "[user] Say something.\n", "add_special_tokens": False},
            ).json()["tokens"]
            rendered = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
            assert rendered["tokens"] == expected
            assert _chat(url).json()["usage"]["prompt_tokens"] == len(expected)
            body = {"model": MODEL, "input": "Say something.", "max_output_tokens": 2}
            usage = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()["usage"]
            assert usage["input_tokens"] == len(expected)
            assert _chat(url, chat_template=template).status_code == 400
