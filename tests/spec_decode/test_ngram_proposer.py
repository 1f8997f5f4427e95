"""Prompt-lookup drafting: the vectorized search against a plain reference implementation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.spec_decode.ngram_proposer import propose_ngram


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """For n from max_n down to min_n: the most recent earlier occurrence of the last n
    tokens; copy what followed, continuing over the copy itself."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                out = list(tokens)
                src = start + n
                for _ in range(k):
                    out.append(out[src])
                    src += 1
                return out[length:]
    return []


def _propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_copies_what_followed_the_most_recent_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # "1 2 3" occurred at 0 and at 5; the most recent (5) was followed by 7 8 5.
    assert _propose(tokens, 2, 3, 3) == [7, 8, 5]


def test_prefers_the_longest_ngram():
    tokens = [4, 2, 3, 50, 1, 2, 3, 60, 9, 3]
    # n=2 "9 3" never recurs... n=1 "3" recurs (most recent at 6 -> 60).
    assert _propose(tokens, 1, 3, 2) == [60, 9]
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3]
    # "1 2 3" (n=3) at 0 beats the more recent "2 3" at 5.
    assert _propose(tokens, 1, 3, 2) == [50, 9]


def test_no_match_or_too_short():
    assert _propose([1, 2, 3, 4, 5], 1, 3, 3) == []
    assert _propose([7], 1, 3, 3) == []
    assert _propose([1, 2, 9, 1, 2], 3, 4, 3) == []  # only a 2-gram recurs


def test_short_period_continues_over_the_copy():
    assert _propose([5, 6, 5, 6, 5, 6], 2, 4, 5) == [5, 6, 5, 6, 5]
    assert _propose([3, 3, 3], 1, 2, 4) == [3, 3, 3, 3]


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(2, 80))]
    min_n = rng.randrange(1, 4)
    max_n = min_n + rng.randrange(0, 4)
    k = rng.randrange(1, 6)
    assert _propose(tokens, min_n, max_n, k) == _reference(tokens, min_n, max_n, k)
