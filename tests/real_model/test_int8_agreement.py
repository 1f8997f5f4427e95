"""int8 against bf16 on the real demo model (issue 12: greedy outputs agree on at least 95% of
tokens), teacher-forced (pagedllm/testing/agreement.py): bf16's own greedy continuations of 32
chat prompts, run as prompts through each engine, and the share of their tokens the engine
ranks first."""

from __future__ import annotations

import pytest

from pagedllm.testing import agreement
from tests.real_model.conftest import MAX_MODEL_LEN

TOKENS = 32


@pytest.fixture(scope="module")
def forced_top1(smollm2_dir):
    """{quantization: teacher-forced top-1 share} against bf16's continuations."""
    from pagedllm import LLM
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    prompts = agreement.chat_prompts(get_tokenizer(smollm2_dir))
    shares, prompt_ids, reference = {}, None, None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        for q in (None, "int8"):
            llm = LLM(
                model=smollm2_dir,
                dtype="bfloat16",
                quantization=q,
                max_model_len=MAX_MODEL_LEN,
                kv_cache_memory_bytes=128 << 20,
            )
            if q is None:
                prompt_ids, reference = agreement.greedy_continuations(llm, prompts, TOKENS)
            shares[q] = agreement.teacher_forced_top1(llm, prompt_ids, reference)
            llm.shutdown()
    return shares


def test_the_measure_sees_only_rounding_on_the_reference_itself(forced_top1):
    # bf16 against its own continuations: prefill and decode round differently, no more.
    assert forced_top1[None] >= 0.97, forced_top1


def test_int8_keeps_95_percent_of_bf16_greedy_tokens(forced_top1):
    assert forced_top1["int8"] >= 0.95, forced_top1
