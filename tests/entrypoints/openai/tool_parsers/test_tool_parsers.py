"""Every tool-call parser on recorded outputs of its format: whole (`extract_tool_calls`) and
streamed token by token (`ToolCallStreamer`), where the deltas must add up to the same calls
and content, in OpenAI's delta shape (the first delta of a call carries id, type and name)."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStreamer,
    ToolParserManager,
)
from pagedllm.testing.demo_model import THINK_AND_TOOL_TOKENS, build_tokenizer

WEATHER = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
TIME = {"zone": "Europe/Paris", "24h": True}

# (parser, recorded output, expected content, expected calls): outputs as the models write them.
RECORDED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", '
        '"state": "TX", "unit": "fahrenheit"}}\n</tool_call>',
        None,
        [("get_current_weather", WEATHER)],
    ),
    (
        "hermes",
        'I will look both up.\n<tool_call>\n{"name": "get_current_weather", "arguments": '
        '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"zone": "Europe/Paris", "24h": true}}\n</tool_call>',
        "I will look both up.\n",
        [("get_current_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "llama3_json",
        '{"name": "get_current_weather", "parameters": {"city": "Dallas", "state": "TX", '
        '"unit": "fahrenheit"}}',
        None,
        [("get_current_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_current_weather", "parameters": {"city": "Dallas", '
        '"state": "TX", "unit": "fahrenheit"}}; {"name": "get_time", "arguments": '
        '{"zone": "Europe/Paris", "24h": true}}',
        None,
        [("get_current_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"city": "Dallas", '
        '"state": "TX", "unit": "fahrenheit"}}, {"name": "get_time", "arguments": '
        '{"zone": "Europe/Paris", "24h": true}}]',
        None,
        [("get_current_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "mistral",
        'Checking. [TOOL_CALLS]get_current_weather[ARGS]{"city": "Dallas", "state": "TX", '
        '"unit": "fahrenheit"}[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris", "24h": true}',
        "Checking. ",
        [("get_current_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "pythonic",
        "[get_current_weather(city='Dallas', state='TX', unit='fahrenheit'), "
        'get_time(zone="Europe/Paris", 24h=True)]'.replace("24h=", "h24="),
        None,
        [("get_current_weather", WEATHER), ("get_time", {"zone": "Europe/Paris", "h24": True})],
    ),
    (
        "pythonic",
        "<|python_start|>[get_current_weather(city='Dallas', state='TX', "
        "unit='fahrenheit')]<|python_end|>",
        None,
        [("get_current_weather", WEATHER)],
    ),
]

# Outputs that are not (or not only) calls: whole, they are content; streamed, the same text.
PLAIN = [
    ("hermes", "The weather in Dallas is sunny; <tool_ is not a call."),
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": '),  # cut
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("llama3_json", "It is sunny in Dallas."),
    ("mistral", "No tools needed [TOOL_CA"),
    ("pythonic", "Sure, get_weather(city='Dallas') would do it."),
    ("pythonic", "[get_weather('Dallas')]"),  # positional arguments are not tool calls
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512, added_tokens=THINK_AND_TOOL_TOKENS)


def token_deltas(tokenizer, text: str) -> list[str]:
    """`text` as an incremental detokenizer streams it: one delta per token (tokens that end
    inside a UTF-8 character wait for the rest)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas, sent = [], ""
    for n in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:n])
        if decoded.endswith("\ufffd") and n < len(ids):
            continue
        deltas.append(decoded[len(sent) :])
        sent = decoded
    assert sent == text
    return deltas


def stream(parser, deltas: list[str], max_calls: int | None = None):
    """Feed the deltas; returns (content, [(name, arguments text)], ids) and checks the shape
    of every tool-call delta."""
    streamer = ToolCallStreamer(parser, max_calls)
    content, calls, ids = "", {}, {}
    steps = [streamer.feed(d) for d in deltas] + [streamer.finish()]
    for step in steps:
        content += step.content
        for tc in step.tool_calls:
            if tc.index not in calls:  # the first delta of a call: id, type, name, no args
                assert tc.index == len(calls)
                assert tc.id and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
                ids[tc.index] = tc.id
            else:
                assert tc.id is None and tc.type is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], ids


@pytest.mark.parametrize("name,output,content,expected", RECORDED)
def test_recorded_outputs_whole_and_streamed(tokenizer, name, output, content, expected):
    parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    info = parser.extract_tool_calls(output)
    assert info.tools_called
    assert info.content == content
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls
    ] == expected
    assert len({c.id for c in info.tool_calls}) == len(expected)
    for deltas in (token_deltas(tokenizer, output), list(output)):
        streamed_content, calls, _ = stream(parser, deltas)
        assert streamed_content == (content or "")
        assert [(n, json.loads(a)) for n, a in calls] == expected
        # Streamed arguments are exactly the whole output's (the raw text, not re-encoded).
        assert [a for _, a in calls] == [c.function.arguments for c in info.tool_calls]


@pytest.mark.parametrize("name,output", PLAIN)
def test_outputs_without_calls_are_content(tokenizer, name, output):
    parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    info = parser.extract_tool_calls(output)
    assert not info.tools_called and info.tool_calls == [] and info.content == output
    content, calls, _ = stream(parser, token_deltas(tokenizer, output))
    if not calls:  # a cut-off call streams its name before the output ends
        assert content == output


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    name, output, _, expected = RECORDED[1]
    parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    info = parser.extract_tool_calls(output, max_calls=1)
    assert [c.function.name for c in info.tool_calls] == [expected[0][0]]
    _, calls, _ = stream(parser, token_deltas(tokenizer, output), max_calls=1)
    assert [n for n, _ in calls] == [expected[0][0]]


def test_held_back_marker_is_released_as_content(tokenizer):
    parser = ToolParserManager.get_tool_parser("hermes")(tokenizer)
    streamer = ToolCallStreamer(parser)
    assert streamer.feed("Answer: 42 <tool_").content == "Answer: 42 "
    assert streamer.finish().content == "<tool_"


def test_mistral_ids_are_nine_alphanumerics(tokenizer):
    parser = ToolParserManager.get_tool_parser("mistral")(tokenizer)
    info = parser.extract_tool_calls(RECORDED[4][1])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in info.tool_calls)


def test_registry_has_vllm_names_and_rejects_others():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="'nope' is not available.*hermes"):
        ToolParserManager.get_tool_parser("nope")
