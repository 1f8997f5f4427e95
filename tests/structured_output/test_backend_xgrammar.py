"""The xgrammar backend: grammar building and its error messages, the tokenizer info (special
tokens hidden, a padded vocabulary never allowed), the JSON-string fixes, and the matcher."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend_xgrammar import (
    StructuredOutputValidator,
    XgrammarBackend,
    build_grammar,
)
from pagedllm.structured_output.bitmask import unpack_bitmask
from pagedllm.testing.demo_model import END_OF_TURN_ID, EOS_ID, SPECIAL_TOKENS
from tests.structured_output.schemas import CHOICES

PADDED_VOCAB = 520  # the tiny model's tokenizer has 512 tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, PADDED_VOCAB, [EOS_ID, END_OF_TURN_ID])


def _allowed(backend, grammar) -> set[int]:
    bitmask = torch.full((1, (PADDED_VOCAB + 31) // 32), -1, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, PADDED_VOCAB)[0]).flatten().tolist())


def _accepts(backend, tokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether `text` (then a stop token) is a complete sentence of `spec`'s language."""
    grammar = backend.new_grammar(backend.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(grammar.accept_token(t) for t in ids) and grammar.accept_token(EOS_ID)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(regex="[a-"), "invalid regex in structured outputs: .*Unclosed '\\['"),
        (dict(json={"type": "foo"}), 'invalid JSON schema .*Unsupported type "foo"'),
        (dict(json={"$ref": "#/defs/x"}), "invalid JSON schema"),
        (dict(grammar='root ::= "a" | '), "invalid grammar .*EBNF parser error"),
        (dict(grammar="start: undefined_rule"), "invalid grammar .*unknown name"),
    ],
)
def test_bad_specs_name_the_compiler_error(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        build_grammar(StructuredOutputsParams(**kwargs))
    assert ".cc:" not in str(info.value)  # no C++ source locations


def test_validator_caches_what_passed(monkeypatch):
    from pagedllm.structured_output import backend_xgrammar

    validate = StructuredOutputValidator(max_cached=2)
    validate(SamplingParams())  # nothing to check
    with pytest.raises(ValueError):
        validate(SamplingParams(structured_outputs={"regex": "("}))
    builds = []
    real_build = backend_xgrammar.build_grammar
    monkeypatch.setattr(
        backend_xgrammar, "build_grammar", lambda s: builds.append(s) or real_build(s)
    )
    for regex in ["a", "a", "b", "a", "c", "b"]:
        validate(SamplingParams(structured_outputs={"regex": regex}))
    assert [s.regex for s in builds] == ["a", "b", "c", "b"]  # "b" was evicted by "c"
    with pytest.raises(ValueError):  # failures are never cached
        validate(SamplingParams(structured_outputs={"regex": "("}))


def test_choice_language_is_exactly_the_choices(backend, tokenizer):
    spec = StructuredOutputsParams(choice=CHOICES)
    for choice in CHOICES:
        assert _accepts(backend, tokenizer, spec, choice), choice
    assert not _accepts(backend, tokenizer, spec, "ye")
    assert not _accepts(backend, tokenizer, spec, "yes no")


def test_special_tokens_are_hidden_and_padding_never_allowed(backend):
    # A regex whose language contains the text of the special tokens ("<|user|>" ...).
    spec = StructuredOutputsParams(regex="[<|>a-z]{1,20}")
    grammar = backend.new_grammar(backend.compile(spec))
    allowed = _allowed(backend, grammar)
    special_ids = set(range(len(SPECIAL_TOKENS)))
    assert not allowed & special_ids
    assert not allowed & set(range(512, PADDED_VOCAB))
    assert len(allowed) > 20
    assert grammar.accept_token(backend_token(backend, "a"))
    # Complete now: the stop tokens (and only they, among the special ids) are allowed.
    assert _allowed(backend, grammar) & special_ids == {EOS_ID, END_OF_TURN_ID}
    assert grammar.accept_token(END_OF_TURN_ID) and grammar.is_terminated()


def backend_token(backend, text: str) -> int:
    vocab = backend.tokenizer_info.decoded_vocab
    return next(i for i, t in enumerate(vocab) if t == text.encode())


@pytest.mark.parametrize("text", ['"ab\x1fc"', '"a\\nb"', '"\ud800"'])
def test_json_strings_reject_raw_control_characters_and_surrogates(backend, tokenizer, text):
    bounded = StructuredOutputsParams(json={"type": "string", "maxLength": 5})
    unbounded = StructuredOutputsParams(json={"type": "string"})
    grammar = backend.new_grammar(backend.compile(bounded))
    raw = text.encode("utf-8", errors="surrogatepass")
    ok = grammar.matcher.accept_string(raw)
    if text == '"a\\nb"':  # an escape: fine in an unbounded string
        assert _accepts(backend, tokenizer, unbounded, text)
    else:
        assert not ok
        grammar = backend.new_grammar(backend.compile(unbounded))
        assert not grammar.matcher.accept_string(raw)


def test_json_whitespace_is_bounded(backend, tokenizer):
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    assert _accepts(backend, tokenizer, spec, '{\n  "a": 1\n}')
    assert not _accepts(backend, tokenizer, spec, "{" + " " * 25 + '"a": 1}')
    compact = StructuredOutputsParams(json=spec.json, disable_any_whitespace=True)
    assert not _accepts(backend, tokenizer, compact, '{ "a": 1}')
    assert _accepts(backend, tokenizer, compact, '{"a": 1}')
