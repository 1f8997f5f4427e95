"""Heads trained by `pagedllm.spec_decode.train_heads` (a few steps on the tiny target) load in
the engine and keep greedy output token-identical to no speculation."""

from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.metrics import SpecDecodingRecorder
from pagedllm.spec_decode.train_heads import train_eagle_head, train_medusa_heads
from pagedllm.testing.copy_model import copy_prompts

KV_BYTES = 16 << 20
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TRAIN = {"steps": 3, "batch_size": 2, "seq_len": 32}


def _generate(target_dir: str, spec_config: dict | None = None) -> tuple[list, LLM]:
    llm = LLM(
        model=target_dir,
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        speculative_config=spec_config,
    )
    recorder = SpecDecodingRecorder()
    llm.llm_engine.stat_loggers.append(recorder)
    prompts = copy_prompts(llm.get_tokenizer(), 3, 40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], recorder


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    return _generate(target_dir)[0]


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_trained_heads_keep_greedy_output(method, target_dir, reference, tmp_path):
    train = train_eagle_head if method == "eagle" else train_medusa_heads
    path, stats = train(tmp_path / method, target_dir, **TRAIN)
    assert stats and all(math.isfinite(v) for v in stats.values())
    spec = {"method": method, "num_speculative_tokens": 3, "model": path}
    outs, recorder = _generate(target_dir, spec)
    assert outs == reference
    assert recorder.num_drafts > 0
