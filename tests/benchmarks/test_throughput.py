"""The hf baseline's batching: in dataset order, capped in size and in prompt + output tokens."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.datasets import SampleRequest
from pagedllm.benchmarks.throughput import plan_hf_batches


def _reqs(*shapes: tuple[int, int]) -> list[SampleRequest]:
    return [SampleRequest([1] * p, o) for p, o in shapes]


def _shapes(batches: list[list[SampleRequest]]) -> list[list[tuple[int, int]]]:
    return [[(r.prompt_len, r.expected_output_len) for r in b] for b in batches]


def test_batches_keep_order_and_size_cap():
    reqs = _reqs(*[(10, 5)] * 7)
    assert [len(b) for b in plan_hf_batches(reqs, 3)] == [3, 3, 1]
    assert [r for b in plan_hf_batches(reqs, 3) for r in b] == reqs


def test_batch_closes_before_passing_the_token_cap():
    # (60 + 50) fits 120; adding (20, 70) would make max prompt 60 + max output 70 = 130.
    reqs = _reqs((60, 50), (10, 10), (20, 70), (5, 5))
    assert _shapes(plan_hf_batches(reqs, 16, max_tokens=120)) == [
        [(60, 50), (10, 10)],
        [(20, 70), (5, 5)],
    ]


def test_an_oversized_request_runs_alone():
    reqs = _reqs((10, 10), (200, 10), (10, 10))
    assert _shapes(plan_hf_batches(reqs, 16, max_tokens=100)) == [
        [(10, 10)],
        [(200, 10)],
        [(10, 10)],
    ]


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="--hf-max-batch-size"):
        plan_hf_batches(_reqs((1, 1)), 0)
