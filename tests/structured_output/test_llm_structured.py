"""Structured outputs end to end through `LLM.generate` on the random-weight tiny Llama: every
output is in the language of its spec, across seeds and temperatures, and together with
preemption, chunked prefill, `n > 1` and unconstrained neighbours."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import (
    CHOICES,
    EMAIL_REGEX,
    PERSON_SCHEMA,
    SMALL_SCHEMA,
    SUM_GRAMMAR,
    check_json,
    in_sum_language,
)

PROMPTS = [
    "Hello there",
    "The engine keeps a small pool",
    "Numbers such as 1, 2, 3",
    "She opened the window",
]
TEMPERATURES = [0.0, 0.8, 1.5]
MAX_TOKENS = 400
KV_CACHE = 4 << 20  # 512 blocks of 16 tokens: plenty, and quick to allocate


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_num_seqs=64, kv_cache_memory=KV_CACHE)


def _generate(llm, specs, temperatures=(1.0,), seeds=(0,), prompts=PROMPTS, **kwargs):
    """One batch over every spec x temperature x seed x prompt (one batch: the engine steps
    as long as the longest output, not the sum). Returns (spec, CompletionOutput) pairs."""
    if not isinstance(specs, list):
        specs = [specs]
    batch, params, owners = [], [], []
    for spec in specs:
        for temperature in temperatures:
            for seed in seeds:
                for prompt in prompts:
                    batch.append(prompt)
                    owners.append(spec)
                    params.append(
                        SamplingParams(
                            temperature=temperature,
                            seed=seed,
                            max_tokens=MAX_TOKENS,
                            structured_outputs=spec,
                            **kwargs,
                        )
                    )
    outs = llm.generate(batch, params, use_tqdm=False)
    return [(spec, c) for spec, o in zip(owners, outs) for c in o.outputs]


def test_json_schema_outputs_validate(llm):
    spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    for _, out in _generate(llm, spec, TEMPERATURES, seeds=(0, 1, 2)):
        check_json(out.text, PERSON_SCHEMA)
        assert out.finish_reason == "stop"
        assert ": " in out.text and "\n" not in out.text  # compact, xgrammar's separators


def test_json_schema_default_whitespace(llm):
    outs = [o for _, o in _generate(llm, StructuredOutputsParams(json=SMALL_SCHEMA), seeds=(0, 1))]
    for out in outs:
        check_json(out.text, SMALL_SCHEMA)
    # Property order follows the schema (it is not sorted or shuffled).
    assert all(out.text.index('"id"') < out.text.index('"ok"') for out in outs)


def test_regex_choice_grammar_outputs(llm):
    regex = StructuredOutputsParams(regex=EMAIL_REGEX)
    choice = StructuredOutputsParams(choice=CHOICES)
    grammar = StructuredOutputsParams(grammar=SUM_GRAMMAR)
    results = _generate(llm, [regex, choice, grammar], TEMPERATURES, seeds=(0, 1, 2))
    for spec, out in results:
        assert out.finish_reason == "stop"
        if spec is regex:
            assert re.fullmatch(EMAIL_REGEX, out.text), out.text
        elif spec is choice:
            assert out.text in CHOICES, out.text
        else:
            assert in_sum_language(out.text), out.text


def test_lark_grammar_and_old_names(llm):
    lark = 'start: WORD ("," WORD)~0..2\nWORD: /[a-z]{1,6}/'
    outs = _generate(llm, GuidedDecodingParams(grammar=lark, backend="xgrammar"))
    assert all(re.fullmatch(r"[a-z]{1,6}(,[a-z]{1,6}){0,2}", o.text) for _, o in outs)
    params = SamplingParams(
        temperature=0.0, max_tokens=50, guided_decoding=GuidedDecodingParams(choice=CHOICES)
    )
    out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert all(o.outputs[0].text in CHOICES for o in out)


def test_json_object(llm):
    """Any JSON object (unbounded, so the test stays greedy with a short answer)."""
    ((_, out),) = _generate(
        llm, StructuredOutputsParams(json_object=True), [0.0], prompts=PROMPTS[:1]
    )
    assert isinstance(check_json(out.text, {"type": "object"}), dict)


def test_unconstrained_neighbours_unchanged(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS,
                                 structured_outputs=spec)  # fmt: skip
    prompts, params = [], []
    for prompt in PROMPTS:  # interleaved: constrained, plain, constrained, plain, ...
        prompts += [prompt, prompt]
        params += [constrained, greedy]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[1::2]] == alone
    for o in outs[0::2]:
        check_json(o.outputs[0].text, PERSON_SCHEMA)


def test_n_greater_than_one(llm):
    spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                            structured_outputs=spec)  # fmt: skip
    (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        check_json(c.text, PERSON_SCHEMA)
    assert len({c.text for c in out.outputs}) > 1  # each child has its own matcher and seed


def test_bad_specs_are_value_errors_and_engine_keeps_serving(llm):
    bad = [
        (dict(regex="[a-"), "regex"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "JSON schema"),
        (dict(grammar='root ::= "a" | '), "grammar"),
        (dict(json='{"type": '), "not valid JSON"),
    ]
    for kwargs, what in bad:
        with pytest.raises(ValueError, match=what):
            llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="Unclosed"):  # the compiler's own words
        llm.generate("hi", SamplingParams(structured_outputs={"regex": "[a-"}))
    outs = _generate(llm, StructuredOutputsParams(choice=CHOICES), [0.0])
    assert all(o.text in CHOICES for _, o in outs)
    assert llm.llm_engine.engine_core.engine_core.structured_output_manager.num_requests == 0


def _engine_outputs(llm, spec, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_preemption_keeps_grammar_state(tiny_llama_dir, llm):
    """A preempted request recomputes its generated tokens without re-feeding its matcher:
    the greedy outputs equal those of an engine that never preempts."""
    spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    prompts = [p + " and more" * i for i, p in enumerate(PROMPTS)]
    expected = _engine_outputs(llm, spec, prompts)
    small = LLM(
        model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192
    )
    assert _engine_outputs(small, spec, prompts) == expected
    assert small.llm_engine.engine_core.engine_core.scheduler.num_preemptions_total > 0
    for text in expected:
        check_json(text, PERSON_SCHEMA)


def test_chunked_prefill_and_prefix_caching(tiny_llama_dir, llm):
    """Long prompts in 16-token chunks (no bitmask row until the last chunk), sharing a
    prefix: same greedy outputs as whole-prompt prefill."""
    spec = StructuredOutputsParams(regex=EMAIL_REGEX)
    shared = " ".join(["the engine keeps a pool of memory blocks"] * 8)
    prompts = [shared + p for p in PROMPTS]
    expected = _engine_outputs(llm, spec, prompts)
    chunked = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=16,
        long_prefill_token_threshold=16,
        enable_prefix_caching=True,
        kv_cache_memory=KV_CACHE,
    )
    assert _engine_outputs(chunked, spec, prompts) == expected
    assert all(re.fullmatch(EMAIL_REGEX, t) for t in expected)


def test_server_wide_compact_json(tiny_llama_dir):
    """structured_outputs_config.disable_any_whitespace: every JSON constraint compact, as a
    request's own disable_any_whitespace makes it."""
    llm = LLM(
        model=tiny_llama_dir, dtype="float32", kv_cache_memory=KV_CACHE,
        structured_outputs_config={"disable_any_whitespace": True},
    )  # fmt: skip
    outs = _generate(llm, StructuredOutputsParams(json=PERSON_SCHEMA), (1.5,), seeds=(0, 1, 2))
    for _, out in outs:
        check_json(out.text, PERSON_SCHEMA)
        assert "\n" not in out.text and "  " not in out.text
    llm.shutdown()
