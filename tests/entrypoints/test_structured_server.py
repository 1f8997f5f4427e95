"""Structured outputs through the OpenAI-compatible server with the official `openai` client:
`response_format` (json_schema, json_object) on chat and completions, vLLM's `guided_*` and
`structured_outputs` fields, streaming, `n > 1`, and 400s for bad specs; tool_choice
"required" and named (calls guaranteed by the same machinery), and the Responses API. One
live `pagedllm serve` (tiny random-weight Llama, EngineCore in its own process) for the
module."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer, stream_chat_chunks
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


# ---- tool_choice "required" and named: guaranteed calls from a random-weight model --------

TOOLS = [
    {"type": "function", "function": {"name": "record", "description": "Store a record",
                                      "parameters": SMALL_SCHEMA}},
    {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"choice": {"enum": ["a", "b", "c"]}},
        "required": ["choice"]}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(message, names: set[str]) -> None:
    assert message.tool_calls and not message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_returns_a_valid_call(server, client):
    named = {"type": "function", "function": {"name": "record"}}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=60,
        temperature=1.0, seed=7, n=3,
    )  # fmt: skip
    for choice in out.choices:
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"record"})
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named,
            "max_tokens": 60, "temperature": 1.0, "seed": 8, "stream": True}  # fmt: skip
    chunks = stream_chat_chunks(server.url, body)
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "record"
    arguments = "".join(d.function.arguments for d in deltas)
    jsonschema.validate(json.loads(arguments), SMALL_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_calls_of_the_tools(client, parallel):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=170,
        temperature=1.0, seed=3, n=3, parallel_tool_calls=parallel,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"record", "pick"})
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_tool_choice_none_renders_tools_and_returns_text(client):
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.0
    )
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5,
        temperature=0.0,
    )  # fmt: skip
    assert not out.choices[0].message.tool_calls and out.choices[0].message.content
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools' JSON


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tools": TOOLS}, "--enable-auto-tool-choice and --tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "'x', which is not in tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
         "tool_choice and guided_regex"),
    ],
)  # fmt: skip
def test_tool_choice_errors_are_400(client, extra, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra
        )
    assert re.search(message, info.value.body["message"]), info.value.body


def test_responses_api_text(server, client):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    kwargs = dict(model=MODEL, instructions="Be brief.", input="Give me a record.",
                  temperature=0.0, max_output_tokens=6)  # fmt: skip
    out = client.responses.create(**kwargs, extra_body={"ignore_eos": True})
    Response.model_validate(out.model_dump(), strict=True)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 6 and out.instructions == "Be brief."
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
    )  # fmt: skip
    assert out.output_text == chat.choices[0].message.content  # the same prompt and text
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    adapter = TypeAdapter(ResponseStreamEvent)
    events = list(client.responses.create(**kwargs, stream=True))
    for event in events:
        adapter.validate_python(event.model_dump(), strict=True)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text == out.output_text
    structured = client.responses.create(
        model=MODEL, input="Give me a record.", max_output_tokens=MAX_TOKENS, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "r", "schema": SMALL_SCHEMA}},
    )  # fmt: skip
    check_json(structured.output_text, SMALL_SCHEMA)
    for extra in ({"store": True}, {"previous_response_id": "resp_1"}, {"web_search": 1}):
        with pytest.raises(openai.BadRequestError, match=next(iter(extra))):
            client.responses.create(model=MODEL, input="hi", extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="text.verbosity='low' is not supported"):
        client.responses.create(model=MODEL, input="hi", text={"verbosity": "low"})
    # vLLM's sampling extras act: the stop string ends the text the chat request ends at.
    stop = out.output_text[2:4]
    stopped = client.responses.create(**kwargs, extra_body={"ignore_eos": True, "stop": [stop]})
    assert stopped.output_text == out.output_text[: out.output_text.index(stop)]
