"""The reasoning parsers on recorded outputs, whole and streamed token by token, with a
tokenizer whose `<think>` / `</think>` are single tokens (as in DeepSeek-R1 and Qwen3)."""

from __future__ import annotations

import pytest

from pagedllm.reasoning import REASONING_PARSERS, ReasoningParserManager
from pagedllm.testing.demo_model import THINK_AND_TOOL_TOKENS, build_tokenizer
from tests.entrypoints.openai.tool_parsers.test_tool_parsers import token_deltas

# (parser, recorded output, reasoning, content)
RECORDED = [
    # R1: the template opened <think> in the prompt; only </think> is generated.
    ("deepseek_r1", "The user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is 4.",
     "The user wants 2+2.\nThat is 4.\n", "\n\nThe answer is 4."),
    # Qwen3 writes <think> itself.
    ("qwen3", "<think>\nShort question, short answer.\n</think>\n\nParis.",
     "\nShort question, short answer.\n", "\n\nParis."),
    # Cut off while thinking: all of it is reasoning.
    ("deepseek_r1", "Let me count: 1, 2, 3", "Let me count: 1, 2, 3", None),
    ("qwen3", "<think>\nStill thinking", "\nStill thinking", None),
    # Nothing after the reasoning.
    ("qwen3", "<think>\nDone.</think>", "\nDone.", None),
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512, added_tokens=THINK_AND_TOOL_TOKENS)


def streamed(parser, tokenizer, output: str) -> tuple[str, str, bool]:
    """(reasoning, content, ended) as the streaming method returns them delta by delta; once
    a delta returns content, the rest is content (the caller's side of the contract)."""
    reasoning, content, previous, ended = "", "", "", False
    for delta in token_deltas(tokenizer, output):
        if ended:
            content += delta
            continue
        current = previous + delta
        result = parser.extract_reasoning_content_streaming(previous, current, delta, (), (), ())
        previous = current
        if result is None:
            continue
        reasoning += result.reasoning or ""
        if result.content is not None:
            content += result.content
            ended = True
    return reasoning, content, ended


@pytest.mark.parametrize("name,output,reasoning,content", RECORDED)
def test_recorded_outputs_whole_and_streamed(tokenizer, name, output, reasoning, content):
    parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    assert parser.extract_reasoning_content(output) == (reasoning, content)
    got_reasoning, got_content, ended = streamed(parser, tokenizer, output)
    assert (got_reasoning, got_content) == (reasoning or "", content or "")
    assert ended == ("</think>" in output)


def test_is_reasoning_end_reads_the_last_marker(tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(tokenizer)

    def ids(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    assert not parser.is_reasoning_end(ids("<|assistant|>\n<think>\n"))
    assert parser.is_reasoning_end(ids("<|assistant|>\n<think>\n\n</think>\n\n"))
    # An earlier turn's closed block does not end the new turn's open one.
    assert not parser.is_reasoning_end(ids("<think>a</think>b<|end|><think>\nc"))
    assert not parser.is_reasoning_end(ids("no markers"))  # reasoning until </think>
    end = tokenizer.convert_tokens_to_ids("</think>")
    assert parser.is_reasoning_end_streaming(ids("<think>x"), [end])
    assert not parser.is_reasoning_end_streaming(ids("<think>x"), ids("y"))


def test_qwen3_enable_thinking_false_is_all_content(tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(
        tokenizer, {"enable_thinking": False}
    )
    assert parser.extract_reasoning_content("Paris.") == (None, "Paris.")
    assert parser.is_reasoning_end([])


def test_parsers_need_their_tokens_and_a_known_name():
    with pytest.raises(ValueError, match=r"\['<think>', '</think>'\]"):
        ReasoningParserManager.get_reasoning_parser("qwen3")(build_tokenizer(512))
    with pytest.raises(ValueError, match="'nope' is not available.*deepseek_r1"):
        ReasoningParserManager.get_reasoning_parser("nope")
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
