"""Structured outputs through the OpenAI-compatible server with the official `openai` client:
`response_format` (json_schema, json_object) on chat and completions, vLLM's `guided_*` and
`structured_outputs` fields, streaming, `n > 1`, and 400s for bad specs. One live `pagedllm
serve` (tiny random-weight Llama, EngineCore in its own process) for the module."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer
from tests.structured_output.schemas import (
    CHOICES,
    EMAIL_REGEX,
    PERSON_SCHEMA,
    SMALL_SCHEMA,
    SUM_GRAMMAR,
    check_json,
    in_sum_language,
)

MODEL = "tiny"
SERVER_ARGS = [
    "--served-model-name", MODEL,
    "--dtype", "float32",
    "--max-model-len", "512",
    "--max-num-seqs", "32",
    "--kv-cache-memory", str(4 << 20),
    "--api-key", API_KEY,
]  # fmt: skip
MAX_TOKENS = 400
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "record", "schema": SMALL_SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Give me a record."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_chat_json_schema_response_format(client):
    for temperature, seed in [(0.0, None), (1.0, 1), (1.5, 2)]:
        out = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=JSON_SCHEMA_FORMAT,
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=seed,
            n=2,
        )
        assert len(out.choices) == 2
        for choice in out.choices:
            check_json(choice.message.content, SMALL_SCHEMA)
            assert choice.finish_reason == "stop"


def test_chat_json_schema_nested_compact(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": PERSON_SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
    )  # fmt: skip
    check_json(out.choices[0].message.content, PERSON_SCHEMA)


def test_chat_json_object_response_format(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    choice = out.choices[0]
    # Any JSON object: unbounded, so a random model may run out of tokens inside it.
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_chat_stream_json_schema(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=JSON_SCHEMA_FORMAT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=4,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check_json(text, SMALL_SCHEMA)


def test_completions_response_format_and_guided_fields(client):
    def complete(**extra):
        out = client.completions.create(
            model=MODEL,
            prompt=["The engine keeps", "Numbers such as"],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=5,
            extra_body=extra,
        )
        assert all(c.finish_reason == "stop" for c in out.choices)
        return [c.text for c in out.choices]

    for text in complete(response_format=JSON_SCHEMA_FORMAT):
        check_json(text, SMALL_SCHEMA)
    for text in complete(guided_json=SMALL_SCHEMA):
        check_json(text, SMALL_SCHEMA)
    assert all(re.fullmatch(EMAIL_REGEX, t) for t in complete(guided_regex=EMAIL_REGEX))
    assert all(t in CHOICES for t in complete(guided_choice=CHOICES))
    assert all(in_sum_language(t) for t in complete(guided_grammar=SUM_GRAMMAR))
    assert all(t in CHOICES for t in complete(structured_outputs={"choice": CHOICES}))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"guided_regex": "[a-"}, "invalid regex .*Unclosed"),
        ({"guided_json": {"type": "foo"}}, "invalid JSON schema .*Unsupported type"),
        ({"guided_grammar": 'root ::= "a" |'}, "invalid grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "only one structured-output"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_specs_are_400_and_the_server_keeps_serving(client, extra, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body=extra)
    assert info.value.status_code == 400
    assert re.search(message, info.value.body["message"]), info.value.body
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"guided_choice": CHOICES},
    )
    assert out.choices[0].message.content in CHOICES
