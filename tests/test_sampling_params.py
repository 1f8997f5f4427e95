"""SamplingParams: validation names the field and the value; normalization; serialization."""

import math

import msgspec
import pytest

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"temperature": -1}, "temperature", "-1"),
        ({"temperature": math.nan}, "temperature", "nan"),
        ({"temperature": math.inf}, "temperature", "inf"),
        ({"top_p": 0}, "top_p", "0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": 1.5}, "min_p", "1.5"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"n": 0}, "n", "0"),
        ({"best_of": 1, "n": 2}, "best_of", "1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "5"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"presence_penalty": 3}, "presence_penalty", "3"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "-2.5"),
        ({"repetition_penalty": 0}, "repetition_penalty", "0"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"prompt_logprobs": -3}, "prompt_logprobs", "-3"),
        ({"stop": [""]}, "stop", "''"),
        ({"stop": ["ok", 3]}, "stop", "3"),
        ({"stop": 5}, "stop", "5"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
        ({"stop_token_ids": 7}, "stop_token_ids", "7"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "[]"),
        ({"allowed_token_ids": [1, -4]}, "allowed_token_ids", "-4"),
        ({"bad_words": "word"}, "bad_words", "'word'"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias", "'a'"),
        ({"logit_bias": [1, 2]}, "logit_bias", "[1, 2]"),
        ({"seed": 1.5}, "seed", "1.5"),
        ({"seed": 2**63}, "seed", str(2**63)),  # torch.Generator / msgpack range
        ({"seed": -(2**63) - 1}, "seed", str(-(2**63) - 1)),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "100.5"),  # OpenAI's range
        ({"logit_bias": {"5": float("nan")}}, "logit_bias", "nan"),
    ],
)
def test_invalid_values_name_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message and value in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_k": -1},
        {"top_k": 0},
        {"top_p": 1.0},
        {"min_tokens": 4, "max_tokens": 4},
        {"max_tokens": None, "min_tokens": 100},
        {"repetition_penalty": 3.0},  # vLLM puts no upper bound on it
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"logit_bias": {5: -100, 6: 100}},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0, "prompt_logprobs": 5},
        {"stop": "###", "stop_token_ids": (3, 4)},
    ],
)
def test_valid_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalization():
    params = SamplingParams(stop="x", top_k=-1, logit_bias={"5": "1.5"})
    assert params.stop == ["x"] and params.top_k == 0 and params.logit_bias == {5: 1.5}
    greedy = SamplingParams(temperature=1e-7, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.sampling_type_greedy
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p) == (0.0, 1.0, 0, 0.0)


def test_eos_and_stop_ids_from_generation_config():
    params = SamplingParams(stop_token_ids=[7])
    params.update_from_generation_config({}, [2, 9])
    assert params.eos_token_id == 2
    assert params.all_stop_token_ids == {7, 9}
    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({}, [2, 9])
    assert ignoring.eos_token_id == 2 and ignoring.all_stop_token_ids == set()


def test_engine_fields_survive_msgpack():
    params = SamplingParams(temperature=0.5, stop_token_ids=[3], bad_words=["no"])
    params.update_from_generation_config({}, [2, 5])
    params._bad_words_token_ids = [[11, 12]]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.eos_token_id == 2
    assert decoded.all_stop_token_ids == {3, 5}
    assert decoded.bad_words_token_ids == [[11, 12]]
    assert decoded.temperature == 0.5


class _FakeTokenizer:
    """Word-level: "bad" and " bad" are distinct tokens; other words split into characters."""

    vocab = {"bad": 1, " bad": 2, "b": 3, "a": 4, " ": 5}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text in self.vocab:
            return [self.vocab[text]]
        return [self.vocab.get(ch, 0) for ch in text]


def test_bad_words_tokenized_with_and_without_leading_space():
    params = SamplingParams(bad_words=["bad", "ab"])
    params.update_from_tokenizer(_FakeTokenizer())
    # "ab" -> [4, 3]; " ab" -> [5, 4, 3] has another length, so it is not added.
    assert params.bad_words_token_ids == [[1], [2], [4, 3]]
    assert SamplingParams().bad_words_token_ids is None


def test_clone_is_equal_and_shares_nothing_mutable():
    """clone() copies flat where it can (no deepcopy of a vocabulary-sized id list); the copy
    must still equal the original field for field and share no container with it."""
    params = SamplingParams(
        stop=["x"],
        stop_token_ids=[5],
        allowed_token_ids=list(range(100)),
        logit_bias={1: 2.0},
        bad_words=["a b"],
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        extra_args={"k": [1]},
    )
    params._bad_words_token_ids = [[3, 4]]
    clone = params.clone()
    for name in SamplingParams.__struct_fields__:
        original, copied = getattr(params, name), getattr(clone, name)
        assert copied == original, name
        if isinstance(original, (list, dict, set, msgspec.Struct)):
            assert copied is not original, name
    clone.allowed_token_ids.append(1000)
    clone._all_stop_token_ids.add(99)
    clone.extra_args["k"].append(2)
    clone._bad_words_token_ids[0].append(7)
    assert len(params.allowed_token_ids) == 100 and 99 not in params._all_stop_token_ids
    assert params.extra_args == {"k": [1]} and params._bad_words_token_ids == [[3, 4]]
