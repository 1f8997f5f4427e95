"""ChatOutputParser: reasoning first, then content and tool calls; a stream (token by token)
adds up to what the whole output parses to."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.chat_output import ChatOutputParser
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.reasoning import ReasoningParserManager
from pagedllm.testing.demo_model import THINK_AND_TOOL_TOKENS, build_tokenizer
from tests.entrypoints.openai.tool_parsers.test_tool_parsers import token_deltas

OUTPUT = (
    "<think>\nThe user asks for the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512, added_tokens=THINK_AND_TOOL_TOKENS)


def make(tokenizer, prompt: str = "<|assistant|>\n", kwargs=None, **options):
    reasoning = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer, kwargs)
    tools = ToolParserManager.get_tool_parser("hermes")(tokenizer)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    return ChatOutputParser(reasoning, prompt_ids, tools, **options)


def run_stream(parser, tokenizer, output):
    deltas = token_deltas(tokenizer, output)
    reasoning, content, calls = "", "", {}
    for i, text in enumerate(deltas):
        delta = parser.feed(text, finished=i == len(deltas) - 1)
        if delta is None:
            continue
        assert delta.reasoning == delta.reasoning_content
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for tc in delta.tool_calls:
            calls.setdefault(tc.index, ["", ""])
            calls[tc.index][0] += tc.function.name or ""
            calls[tc.index][1] += tc.function.arguments or ""
    return reasoning, content, [tuple(c) for c in calls.values()]


def test_reasoning_content_and_tool_call(tokenizer):
    whole = make(tokenizer).parse(OUTPUT)
    assert whole.reasoning == "\nThe user asks for the weather.\n"
    assert whole.content == "\n\nLet me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    parser = make(tokenizer)
    assert run_stream(parser, tokenizer, OUTPUT) == (
        whole.reasoning,
        whole.content,
        [("get_weather", whole.tool_calls[0].function.arguments)],
    )
    assert parser.tools_called


def test_closed_think_block_in_the_prompt_means_no_reasoning(tokenizer):
    # What the chat template renders for enable_thinking=False.
    parser = make(tokenizer, "<|assistant|>\n<think>\n\n</think>\n\n")
    whole = parser.parse("Paris.")
    assert (whole.reasoning, whole.content) == (None, "Paris.")
    assert run_stream(parser, tokenizer, "Paris.") == ("", "Paris.", [])


def test_include_reasoning_false_drops_it(tokenizer):
    whole = make(tokenizer, include_reasoning=False).parse(OUTPUT)
    assert whole.reasoning is None and whole.tool_calls
    reasoning, _, calls = run_stream(make(tokenizer, include_reasoning=False), tokenizer, OUTPUT)
    assert reasoning == "" and calls
