"""The Triton top-k / top-p mask equals the PyTorch ops' on random and on heavily tied logits,
with rows that disable either part and logits already masked to -inf."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample import ops
from tests.ops.triton.devices import TRITON_DEVICES


def _rows(vocab_size: int, ties: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab_size, generator=gen) * 3
    if ties:
        logits = (logits * 2).round() / 2  # a few dozen distinct values per row
    logits[2, ::7] = float("-inf")  # banned / min-p-masked tokens
    top_k = torch.tensor([1, 5, vocab_size, 40, vocab_size, 3])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 0.999, 0.05])
    return logits, top_k, top_p


def _triton(logits, top_k, top_p, device):
    from pagedllm.ops.triton.top_k_top_p import apply_top_k_top_p_triton

    def to(t):
        return None if t is None else t.to(device)

    return apply_top_k_top_p_triton(logits.clone().to(device), to(top_k), to(top_p)).cpu()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("vocab_size", [50, 1300])
@pytest.mark.parametrize("parts", ["k", "p", "kp"])
def test_matches_sorting_ops(device, vocab_size, parts):
    """Distinct logits: the same mask as apply_top_k then apply_top_p_sorted (the sort-based
    path the sampler otherwise takes on the GPU)."""
    logits, top_k, top_p = _rows(vocab_size, ties=False, seed=vocab_size)
    top_k = top_k if "k" in parts else None
    top_p = top_p if "p" in parts else None
    ref = logits.clone()
    if top_k is not None:
        ref = ops.apply_top_k(ref, top_k, int(top_k[top_k < vocab_size].max()))
    if top_p is not None:
        ref = ops.apply_top_p_sorted(ref, top_p)
    out = _triton(logits, top_k, top_p, device)
    assert torch.equal(out, ref)
    assert (out[:, :].isfinite().sum(1) >= 1).all()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_ties_with_the_last_kept_token_are_kept(device):
    """Tied logits: the same mask as the partial (tie-keeping) op over the whole vocabulary."""
    vocab_size = 300
    logits, top_k, top_p = _rows(vocab_size, ties=True, seed=1)
    max_top_k = int(top_k[top_k < vocab_size].max())
    ref = ops.apply_top_k_top_p_partial(
        logits.clone(), top_k, top_p, max_top_k, num_candidates=vocab_size
    )
    assert ref is not None
    assert torch.equal(_triton(logits, top_k, top_p, device), ref)
