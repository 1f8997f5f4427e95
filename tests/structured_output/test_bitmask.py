"""Applying the packed bitmask to the logits: only the structured rows change, bitmask rows are
matched to logits rows by request id (one row per verified position with speculative
decoding), padded logits columns are masked, and the CPU kernels (pagedllm's native one for float32
rows, xgrammar's for bfloat16) agree with the torch unpacking used on other devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.core.sched.output import CachedRequestData, SchedulerOutput
from pagedllm.structured_output.bitmask import (
    apply_grammar_bitmask,
    apply_token_bitmask,
    unpack_bitmask,
)

VOCAB = 70  # 3 words of 32 bits; the last one only partly used


def _pack(allowed: list[set[int]], vocab: int = VOCAB) -> np.ndarray:
    words = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.uint32)
    for row, ids in enumerate(allowed):
        for t in ids:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_unpack_matches_pack():
    allowed = [{0, 31, 32, 63, 64, 69}, set(range(VOCAB))]
    unpacked = unpack_bitmask(torch.from_numpy(_pack(allowed)), VOCAB)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in unpacked] == allowed


# float32 takes the native kernel (where built), bfloat16 xgrammar's CPU kernel, float64 the
# torch unpacking (as on a GPU).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_only_structured_rows_are_masked_by_their_own_row(dtype):
    logits = torch.randn(4, VOCAB).to(dtype)
    original = logits.clone()
    # Bitmask rows: b -> 0, d -> 1; logits rows: a, b, c, d (a and c unconstrained).
    bitmask = _pack([{1, 2, 40}, {69}])
    apply_token_bitmask(logits, bitmask, np.array([1, 3]), np.array([0, 1]))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert set(torch.nonzero(logits[1] > -float("inf")).flatten().tolist()) == {1, 2, 40}
    assert torch.nonzero(logits[3] > -float("inf")).flatten().tolist() == [69]
    assert torch.equal(logits[1, [1, 2, 40]], original[1, [1, 2, 40]])


def test_cpu_kernel_agrees_with_torch_unpacking():
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, VOCAB)
    expected = logits.masked_fill(~unpack_bitmask(torch.from_numpy(bitmask), VOCAB), -np.inf)
    apply_token_bitmask(logits, bitmask, np.arange(3), np.arange(3))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_on_whole_and_partial_words_in_any_row_order(dtype):
    vocab = 1000  # 31 whole words and 8 bits of a 32nd
    rng = np.random.default_rng(1)
    bitmask = rng.integers(-(2**31), 2**31, size=(5, 32), dtype=np.int64).astype(np.int32)
    bitmask[0, :] = -1  # every token allowed
    bitmask[1, :] = 0  # none
    bitmask[2, 3] = -1
    bitmask[3, 31] = 0
    logits = torch.randn(7, vocab).to(dtype)
    rows, mask_rows = np.array([6, 0, 3, 1, 4]), np.array([2, 4, 0, 1, 3])
    expected = logits.clone()
    allowed = unpack_bitmask(torch.from_numpy(bitmask), vocab)
    expected[rows] = expected[rows].masked_fill(~allowed[mask_rows], -np.inf)
    apply_token_bitmask(logits, bitmask, rows, mask_rows)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padded_logits_columns_are_masked_for_structured_rows(dtype):
    logits = torch.zeros(2, 100, dtype=dtype)  # wider than the 96 columns the bitmask covers
    bitmask = np.full((1, 3), -1, dtype=np.int32)  # everything it covers is allowed
    apply_token_bitmask(logits, bitmask, np.array([0]), np.array([0]))
    assert torch.isinf(logits[0, 96:]).all() and not torch.isinf(logits[0, :96]).any()
    assert not torch.isinf(logits[1]).any()


def test_apply_grammar_bitmask_reads_the_scheduler_output():
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
    )
    logits = torch.zeros(2, VOCAB)
    one_row = np.ones(2, dtype=np.int64)
    apply_grammar_bitmask(logits, so, ["a", "b"], one_row)  # no bitmask: nothing happens
    assert not torch.isinf(logits).any()
    so.structured_output_request_ids = {"b": 0}
    so.grammar_bitmask = _pack([{5}])
    apply_grammar_bitmask(logits, so, ["a", "b"], one_row)
    assert not torch.isinf(logits[0]).any()
    assert torch.nonzero(logits[1] == 0).flatten().tolist() == [5]


def test_rows_of_requests_verifying_drafts_line_up():
    """Logits rows: a (plain, 2 drafts) 0-2, b (structured, 1 draft) 3-4, c (structured, no
    draft) 5; bitmask rows: b 0-1, c 2."""
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": 3, "b": 2, "c": 1},
        total_num_scheduled_tokens=6,
        scheduled_spec_decode_tokens={"a": [1, 2], "b": [3]},
    )
    so.structured_output_request_ids = {"b": 0, "c": 2}
    so.grammar_bitmask = _pack([{3}, {4, 5}, {6}])
    logits = torch.zeros(6, VOCAB)
    apply_grammar_bitmask(logits, so, ["a", "b", "c"], np.array([3, 2, 1]))
    allowed = [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]
    assert allowed == [set(range(VOCAB))] * 3 + [{3}, {4, 5}, {6}]
