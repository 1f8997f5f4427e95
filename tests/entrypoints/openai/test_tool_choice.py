"""tool_choice: defaults and 400s, the JSON schemas that force calls (checked with jsonschema
against outputs and compiled by xgrammar), the parsers of forced outputs, and tool-call
history prepared for chat templates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.entrypoints.chat_utils import history_for_template
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
)
from pagedllm.entrypoints.openai.tool_choice import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    effective_tool_choice,
    select_tool_parser,
    tool_choice_json_schema,
)
from pagedllm.structured_output.backend_xgrammar import build_grammar

ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    ChatCompletionToolsParam.model_validate(t)
    for t in [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"where": {"$ref": "#/$defs/address"}},
            "required": ["where"], "$defs": {"address": ADDRESS}}}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
]  # fmt: skip
NAMED = ChatCompletionNamedToolChoiceParam.model_validate({"function": {"name": "get_weather"}})


def test_defaults_and_errors():
    assert effective_tool_choice(TOOLS, None) == "auto"
    assert effective_tool_choice(None, None) == "none"
    with pytest.raises(ValueError, match="needs `tools`"):
        effective_tool_choice(None, "required")
    missing = ChatCompletionNamedToolChoiceParam.model_validate({"function": {"name": "nope"}})
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        effective_tool_choice(TOOLS, missing)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice and --tool-call-parser"):
        select_tool_parser(TOOLS, "auto", None, None)
    assert select_tool_parser(TOOLS, "none", None, None) is None


def test_named_schema_is_the_function_parameters():
    schema = tool_choice_json_schema(TOOLS, NAMED)
    assert schema == TOOLS[0].function.parameters
    jsonschema.validate({"where": {"city": "Paris"}}, schema)
    build_grammar(ChatCompletionRequest(messages=[], tools=TOOLS, tool_choice=NAMED)
                  .to_structured_outputs())  # fmt: skip


def test_required_schema_is_an_array_of_calls_with_shared_defs():
    schema = tool_choice_json_schema(TOOLS, "required")
    assert schema["$defs"] == {"address": ADDRESS} and schema["minItems"] == 1
    calls = [
        {"name": "get_weather", "parameters": {"where": {"city": "Paris"}}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(calls, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_json_schema(TOOLS, "required", parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, single)
    request = ChatCompletionRequest(messages=[], tools=TOOLS, tool_choice="required")
    assert request.to_structured_outputs().json == schema
    build_grammar(request.to_structured_outputs())


def test_a_forced_call_cannot_be_combined_with_another_constraint():
    request = ChatCompletionRequest(
        messages=[], tools=TOOLS, tool_choice="required", guided_regex="a+"
    )
    with pytest.raises(ValueError, match="tool_choice and guided_regex"):
        request.to_structured_outputs()
    auto = ChatCompletionRequest(messages=[], tools=TOOLS, guided_regex="a+")
    assert auto.to_structured_outputs().regex == "a+"


def test_forced_output_parsers():
    named = NamedToolCallParser(None, "get_weather")
    info = named.extract_tool_calls(' {"where": {"city": "Paris"}}')
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        ("get_weather", '{"where": {"city": "Paris"}}')
    ]
    assert not named.extract_tool_calls('{"where": {"ci').tools_called  # cut off
    required = RequiredToolCallsParser(None)
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": 1}]'
    info = required.extract_tool_calls(text)
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        ("get_time", "{}"),
        ("get_weather", "1"),
    ]
    assert info.content is None


def test_history_tool_calls_reach_templates_as_objects():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": json.dumps({"a": 1})}}],
    }  # fmt: skip
    out = history_for_template(message)
    assert out["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not modified
