"""limits.py without a server: the JSON walk names the field at fault, and the limits resolve
from the flags and the vocabulary."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.limits import (
    MAX_JSON_DEPTH,
    ServerLimits,
    check_json_value,
    parse_json_body,
)


@pytest.mark.parametrize(
    "value, field, needle",
    [
        ({"prompt": "a\ud800"}, "prompt", "U+D800 at index 1"),
        ({"messages": [{"role": "user", "content": ["x", "\udfff"]}]}, "messages[0].content[1]", "surrogate"),
        ({"a": {"b\udc00": 1}}, "a", "surrogate"),  # a key
        ({"prompt": [1, 2, 2**64]}, "prompt[2]", "64 bits"),
        ({"prompt": [[1], [-(2**63) - 1]]}, "prompt[1][0]", "64 bits"),
        ({"seed": 2**70}, "seed", "64 bits"),
        ({"top_p": float("inf")}, "top_p", "finite"),
        ({"logit_bias": {"5": float("nan")}}, "logit_bias.5", "finite"),
    ],
)  # fmt: skip
def test_walk_names_the_field(value, field, needle):
    with pytest.raises(OpenAIError) as info:
        check_json_value(value)
    assert info.value.param == field and needle in info.value.message
    assert info.value.status_code == 400


def test_walk_accepts_what_the_engine_takes_and_bounds_depth():
    check_json_value(
        {"prompt": [0, 2**64 - 1, -(2**63)], "text": "héllo ✓ 🙂", "x": [True, None, 1.5]}
    )
    nested: list = []
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = [nested]
    check_json_value({"x": nested})  # MAX_JSON_DEPTH levels in all
    with pytest.raises(OpenAIError, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json_value({"x": [nested]})


def test_parse_json_body():
    assert parse_json_body(b'{"prompt": "caf\xc3\xa9"}') == {"prompt": "café"}
    with pytest.raises(OpenAIError, match="not valid UTF-8 \\(byte 0xe9 at offset 15\\)"):
        parse_json_body(b'{"prompt": "caf\xe9"}')
    with pytest.raises(OpenAIError, match="deeper than"):
        parse_json_body(b"[" * 100_000 + b"]" * 100_000)


class _Vocab:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "Ġhello": 1, "<|special|>": 2}


def test_limits_resolve_from_flags_and_vocabulary():
    limits = ServerLimits.from_args(None).for_model(_Vocab(), max_model_len=100)
    assert limits.max_prompt_chars == 100 * len("<|special|>")
    limits.check_prompt_chars("x" * limits.max_prompt_chars, "prompt")
    with pytest.raises(OpenAIError, match="cannot fit in max_model_len=100") as info:
        limits.check_prompt_chars("x" * (limits.max_prompt_chars + 1), "messages")
    assert info.value.param == "messages"
    args = argparse.Namespace(max_prompt_chars=7, max_n_sequences=3, max_request_body_bytes=9)
    limits = ServerLimits.from_args(args).for_model(_Vocab(), max_model_len=100)
    assert (limits.max_prompt_chars, limits.max_n_sequences, limits.max_request_body_bytes) == (
        7,
        3,
        9,
    )
    limits.check_n(3)
    with pytest.raises(OpenAIError, match="--max-n-sequences"):
        limits.check_n(4)
    with pytest.raises(ValueError, match="--max-prompt-chars=0"):
        ServerLimits.from_args(argparse.Namespace(max_prompt_chars=0))
