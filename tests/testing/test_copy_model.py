"""The copy-model maker behind the speculative-decoding benchmark's repetitive workload."""

import torch

from pagedllm.testing.copy_model import copy_alphabet, copy_prompts, periodic_batch
from pagedllm.testing.demo_model import build_tokenizer


def test_periodic_batch_rows_repeat_a_short_pattern():
    tokens = torch.arange(10, 20)
    batch = periodic_batch(tokens, 8, 60, torch.Generator().manual_seed(0))
    assert batch.shape == (8, 60)
    for row in batch.tolist():
        period = next(p for p in range(3, 25) if row[p:] == row[:-p])
        assert all(10 <= t < 20 for t in row[:period])


def test_copy_prompts_use_ordinary_tokens_only():
    tokenizer = build_tokenizer(512)
    alphabet = copy_alphabet(tokenizer, 64)
    assert len(alphabet) == 64 and not set(alphabet.tolist()) & set(tokenizer.all_special_ids)
    prompts = copy_prompts(tokenizer, 3, 40, alphabet=64)
    assert len(prompts) == 3 and all(len(p) == 40 for p in prompts)
    assert set(sum(prompts, [])) <= set(alphabet.tolist())
