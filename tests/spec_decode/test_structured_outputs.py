"""Structured outputs with speculative decoding, end to end: structured requests get drafts
(cut to what their grammar accepts) and verify them with one bitmask row per position, so
greedy output is token-identical to decoding without speculation and stays in the grammar's
language, also under chunked prefill, preemption and n > 1."""

from __future__ import annotations

import random
import re

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.spec_decode.metrics import SpecDecodingRecorder
from tests.structured_output.schemas import CHOICES, EMAIL_REGEX, PERSON_SCHEMA, check_json

METHODS = ["ngram", "draft_model", "draft_is_target", "eagle", "medusa"]
KV_BYTES = 16 << 20
SPECS = {
    "json": StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=EMAIL_REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
}
PROMPTS = ["Hello there", "The engine keeps a small pool", "She opened the window"]


def _structured(kind: str, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": 200, **kwargs}, structured_outputs=SPECS[kind]
    )


def _batch() -> tuple[list, list[SamplingParams], list[str]]:
    """Every spec kind x every prompt."""
    prompts, params, kinds = [], [], []
    for kind in SPECS:
        for prompt in PROMPTS:
            prompts.append(prompt)
            params.append(_structured(kind))
            kinds.append(kind)
    return prompts, params, kinds


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_language(kind: str, text: str) -> None:
    if kind == "json":
        check_json(text, PERSON_SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(EMAIL_REGEX, text), text
    else:
        assert text in CHOICES


def _spec_llm(target_dir, spec_config, **kwargs) -> tuple[LLM, SpecDecodingRecorder]:
    llm = LLM(
        model=target_dir,
        dtype="float32",
        **{"kv_cache_memory": KV_BYTES, **kwargs},
        speculative_config=spec_config,
    )
    recorder = SpecDecodingRecorder()
    llm.llm_engine.stat_loggers.append(recorder)
    return llm, recorder


@pytest.fixture(scope="module")
def plain_llm(target_dir) -> LLM:
    return LLM(model=target_dir, dtype="float32", kv_cache_memory=KV_BYTES)


@pytest.fixture(scope="module")
def reference(plain_llm) -> list[list[int]]:
    prompts, params, _ = _batch()
    return _tokens(plain_llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("method", METHODS)
def test_greedy_structured_output_is_token_identical(method, target_dir, spec_configs, reference):
    llm, totals = _spec_llm(target_dir, spec_configs[method])
    prompts, params, kinds = _batch()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == reference
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop"
        _check_language(kind, out.outputs[0].text)
    if method == "draft_is_target":
        # Only structured requests here, and they speculate. The draft is the target's
        # unmasked argmax: one the grammar allows is the masked argmax too, so every draft
        # that survives the grammar's cut is accepted.
        assert totals.num_draft_tokens > 20
        assert totals.num_accepted_tokens == totals.num_draft_tokens


def test_identical_with_chunked_prefill_and_preemption(target_dir, spec_configs, plain_llm):
    """Long token prompts in an 8-token budget and 16 KV blocks for six requests: prefill is
    chunked, requests are preempted and recomputed, their matchers untouched."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (30, 41, 25, 36, 19, 44)]
    kinds = ["json", "regex", "choice", "json", "regex", "json"]
    params = [_structured(kind, max_tokens=70) for kind in kinds]
    batch = [{"prompt_token_ids": p} for p in prompts]
    expected = _tokens(plain_llm.generate(batch, params, use_tqdm=False))
    llm, totals = _spec_llm(
        target_dir,
        spec_configs["draft_is_target"],
        kv_cache_memory=None,
        max_model_len=128,
        max_num_batched_tokens=8,
        num_gpu_blocks_override=16,
    )
    assert _tokens(llm.generate(batch, params, use_tqdm=False)) == expected
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.num_preemptions_total > 0 and totals.num_draft_tokens > 0
    scheduler.check_integrity()


def test_n_greater_than_one(target_dir, spec_configs, reference):
    """Greedy children equal the single greedy output; seeded sampling children each have
    their own matcher and stay in the language."""
    llm, _ = _spec_llm(target_dir, spec_configs["draft_is_target"])
    outs = llm.generate(
        [PROMPTS[0], PROMPTS[1]],
        [
            _structured("json", n=2),
            _structured("json", n=3, temperature=1.0, seed=0, max_tokens=300),
        ],
        use_tqdm=False,
    )
    assert [list(c.token_ids) for c in outs[0].outputs] == [reference[0]] * 2
    assert len(outs[1].outputs) == 3
    for completion in outs[1].outputs:
        assert completion.finish_reason == "stop"
        check_json(completion.text, PERSON_SCHEMA)
