"""pagedllm on a real model (SmolLM2-135M-Instruct, fp32): token for token what transformers
generates, and sensible chat, stop strings and structured outputs through its template."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedllm import SamplingParams, StructuredOutputsParams
from tests.real_model.conftest import PARIS_QUESTION

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]


@pytest.mark.slow
def test_greedy_matches_transformers(smollm2_dir, smollm2_llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = ref.generate(ids, max_new_tokens=12, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def _chat(llm, question: str, **params):
    messages = [{"role": "user", "content": question}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, **params), use_tqdm=False)
    return out[0].outputs[0]


def test_chat_answers_through_the_template(smollm2_llm):
    out = _chat(smollm2_llm, PARIS_QUESTION, max_tokens=32)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|>, the chat template's end of turn
    assert "<|im_end|>" not in out.text


def test_stop_string_cuts_the_answer(smollm2_llm):
    full = _chat(smollm2_llm, PARIS_QUESTION, max_tokens=32).text
    cut = _chat(smollm2_llm, PARIS_QUESTION, max_tokens=32, stop=[" Paris"])
    assert cut.finish_reason == "stop" and cut.stop_reason == " Paris"
    assert cut.text == full[: full.index(" Paris")]
    kept = _chat(
        smollm2_llm, PARIS_QUESTION, max_tokens=32, stop=[" Paris"], include_stop_str_in_output=True
    )
    assert kept.text == cut.text + " Paris"


CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


def test_structured_output_is_sensible_json(smollm2_llm):
    question = "Give the capital of France as JSON with the keys country and capital."
    out = _chat(
        smollm2_llm,
        question,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(json=CAPITAL_SCHEMA),
    )
    value = json.loads(out.text)
    jsonschema.validate(value, CAPITAL_SCHEMA)
    assert value["capital"] == "Paris"


def test_parameter_count_is_the_checkpoints(smollm2_dir, make_engine_config):
    """The load log's count is taken before the CPU GEMM layouts repack the weights (bf16 on
    AVX-512 CPUs packs them into panels, which once counted 28.3M here)."""
    from pagedllm.models.loader import get_model

    model = get_model(make_engine_config(smollm2_dir, dtype=torch.bfloat16, max_model_len=256))
    assert model.num_checkpoint_parameters == 134_515_008  # SmolLM2-135M, embedding tied
