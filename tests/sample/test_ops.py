"""The logits-processing ops on small hand-computed examples."""

import math

import pytest
import torch

from pagedllm.sample import ops
from tests.sample.stats import CHI2_999, chi_square

NEG_INF = float("-inf")


def _kept(logits: torch.Tensor) -> list[list[int]]:
    """Token ids left finite in each row."""
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    # Row 0 saw {0, 1, 3} (padded by repeating 3); row 1 has no penalty (lists nothing).
    token_ids = torch.tensor([[0, 1, 3, 3], [0, 0, 0, 0]])
    out = ops.apply_repetition_penalty(logits.clone(), token_ids, torch.tensor([2.0, 1.0]))
    assert out.tolist() == [[1.0, -2.0, 0.5, -1.0, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]]


def test_frequency_presence_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    # Row 0 generated token 1 twice and token 2 once; row 1 token 4 once (then padding).
    token_ids = torch.tensor([[1, 2], [4, 0]])
    counts = torch.tensor([[2.0, 1.0], [1.0, 0.0]])
    out = ops.apply_frequency_presence_penalties(
        logits.clone(), token_ids, counts, torch.tensor([0.5, -0.5]), torch.tensor([0.25, 1.0])
    )
    # Row 0: token 1: -1 - 0.5 * 2 - 0.25; token 2: 0.5 - 0.5 - 0.25. Row 1: token 4: 1 + 0.5 - 1.
    assert out[0].tolist() == pytest.approx([2.0, -2.25, -0.25, -0.5, 1.0])
    assert out[1].tolist() == pytest.approx([2.0, -1.0, 0.5, -0.5, 0.5])


def _top_p_sorted(logits, top_k, top_p, max_top_k):
    if top_k is not None:
        logits = ops.apply_top_k(logits, top_k, max_top_k)
    return ops.apply_top_p_sorted(logits, top_p)


def _top_p_partial(logits, top_k, top_p, max_top_k):
    out = ops.apply_top_k_top_p_partial(logits, top_k, top_p, max_top_k)
    assert out is not None
    return out


TOP_P_IMPLS = pytest.mark.parametrize(
    "impl",
    [_top_p_sorted, _top_p_partial, ops.apply_top_k_top_p],
    ids=["sorted", "partial", "auto"],
)


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_keeps_ties(with_top_p):
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0], [1.0, 5.0, 3.0, 5.0, 2.0], [0.0, 1, 2, 3, 4]])
    top_k = torch.tensor([2, 3, 5])  # 5 = V: disabled
    top_p = torch.ones(3) if with_top_p else None
    out = ops.apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k=3)
    assert _kept(out) == [[1, 3], [1, 2, 3], [0, 1, 2, 3, 4]]
    assert out[0, 1] == 5.0  # kept logits are untouched


@TOP_P_IMPLS
def test_top_p_nucleus(impl):
    probs = [0.05, 0.5, 0.15, 0.3]  # shuffled, to check the scatter back
    logits = _log(probs).repeat(4, 1)
    top_p = torch.tensor([0.7, 0.45, 0.9, 1.0])
    out = impl(logits.clone(), None, top_p, 0)
    # Mass ahead of each token (by rank): 0.5 -> 0, 0.3 -> 0.5, 0.15 -> 0.8, 0.05 -> 0.95.
    assert _kept(out) == [[1, 3], [1], [1, 2, 3], [0, 1, 2, 3]]


@TOP_P_IMPLS
def test_top_p_one_keeps_tiny_tail(impl):
    logits = torch.cat([torch.tensor([[30.0]]), torch.zeros(1, 999) - 30.0], dim=1)
    out = impl(logits.clone(), None, torch.tensor([1.0]), 0)
    assert torch.isfinite(out).all()


@TOP_P_IMPLS
def test_top_k_then_top_p(impl):
    logits = _log([0.4, 0.3, 0.2, 0.1]).repeat(3, 1)
    # After top-3 the mass is renormalized: 0.444, 0.333, 0.222 (ahead: 0, 0.444, 0.777).
    top_k = torch.tensor([3, 3, 4])  # 4 = V: row 2 has top-p only (ahead: 0, .4, .7, .9)
    out = impl(logits.clone(), top_k, torch.tensor([0.9, 0.7, 0.75]), 3)
    assert _kept(out) == [[0, 1, 2], [0, 1], [0, 1, 2]]


def test_partial_top_p_gives_up_beyond_candidates():
    logits = torch.zeros(2, 3000)  # flat: a 0.9 nucleus needs 2700 tokens
    before = logits.clone()
    assert ops.apply_top_k_top_p_partial(logits, None, torch.tensor([0.9, 1.0])) is None
    assert torch.equal(logits, before)
    out = ops.apply_top_k_top_p(logits, None, torch.tensor([0.9, 1.0]))  # falls back to sort
    assert torch.isfinite(out).sum(-1).tolist() == [2700, 3000]


def test_partial_matches_sorted_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=gen) * 3
    top_k = torch.randint(1, 5001, (64,), generator=gen)
    top_k[::3] = 5000
    top_p = torch.rand(64, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0
    max_top_k = int(top_k[top_k < 5000].max())
    sorted_out = _top_p_sorted(logits.clone(), top_k, top_p, max_top_k)
    partial_out = ops.apply_top_k_top_p_partial(
        logits.clone(), top_k, top_p, max_top_k, num_candidates=5000
    )
    assert torch.equal(torch.isfinite(sorted_out), torch.isfinite(partial_out))


def test_min_p():
    logits = _log([0.5, 0.3, 0.15, 0.05]).repeat(3, 1)
    out = ops.apply_min_p(logits.clone(), torch.tensor([0.2, 0.5, 0.0]))
    assert _kept(out) == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_temperature_zero_rows_untouched():
    logits = torch.tensor([[2.0, 4.0], [2.0, 4.0]])
    out = ops.apply_temperature(logits.clone(), torch.tensor([0.5, 0.0]))
    assert out.tolist() == [[4.0, 8.0], [2.0, 4.0]]


def test_allowed_token_ids():
    logits = torch.zeros(3, 5)
    mask = torch.full((2, 5), float("-inf"))
    mask[0, [1, 3]] = 0.0
    mask[1, 4] = 0.0
    out = ops.apply_allowed_token_ids(logits, torch.tensor([0, 2]), mask)
    assert _kept(out) == [[1, 3], [0, 1, 2, 3, 4], [4]]
    # Every row restricted: the mask applies in place, row for row; allowed logits unchanged.
    logits = torch.arange(10.0).reshape(2, 5)
    out = ops.apply_allowed_token_ids(logits, torch.tensor([0, 1]), mask)
    assert _kept(out) == [[1, 3], [4]]
    assert out[0, 1] == 1.0 and out[0, 3] == 3.0 and out[1, 4] == 9.0


def test_banned_and_logit_bias():
    logits = torch.zeros(2, 4)
    out = ops.apply_banned_tokens(logits, torch.tensor([0, 1]), torch.tensor([2, 0]))
    out = ops.apply_logit_bias(
        out, torch.tensor([0, 1]), torch.tensor([1, 3]), torch.tensor([1.5, -2])
    )
    assert out.tolist() == [[0.0, 1.5, NEG_INF, 0.0], [NEG_INF, 0.0, 0.0, -2.0]]


def test_random_sample_generator_rows_reproducible():
    probs = torch.full((3, 50), 1 / 50)
    draws = []
    for _ in range(2):
        gens = {0: torch.Generator().manual_seed(7), 2: torch.Generator().manual_seed(8)}
        draws.append([ops.random_sample(probs.clone(), gens).tolist() for _ in range(5)])
    assert [d[0] for d in draws[0]] == [d[0] for d in draws[1]]
    assert [d[2] for d in draws[0]] == [d[2] for d in draws[1]]
    assert [d[0] for d in draws[0]] != [d[2] for d in draws[0]]


def test_random_sample_never_picks_zero_probability():
    probs = torch.zeros(1000, 8)
    probs[:, 3] = 0.25
    probs[:, 6] = 0.75
    out = ops.random_sample(probs, {})
    assert set(out.tolist()) == {3, 6}


def _nucleus(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference: the nucleus-renormalized distribution, tokens tied with the last kept one
    kept (a token stays when the mass strictly more probable than it is < top_p)."""
    probs = weights / weights.sum()
    ahead = torch.stack([probs[probs > q].sum() for q in probs])
    kept = probs * (ahead < top_p) if top_p < 1.0 else probs
    return kept / kept.sum()


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.62, 0.8, 0.95, 1.0])
def test_random_sample_top_p_matches_nucleus_distribution(top_p):
    torch.manual_seed(0)
    weights = torch.tensor([3.0, 1.0, 2.5, 0.5, 2.0, 1.0, 0.0, 0.25])  # tie at 1.0, a zero
    n = 20000
    draws = ops.random_sample_top_p(weights.repeat(n, 1), torch.full((n,), top_p), {})
    expected = _nucleus(weights, top_p)
    assert chi_square(draws, expected) < CHI2_999[max(1, int((expected > 0).sum()) - 1)]


def test_random_sample_top_p_mixed_rows_and_flat_rows():
    """Rows with different p (one disabled) in one batch, on a wide flat-ish vocabulary where
    the nucleus holds thousands of tokens: no draw outside a row's nucleus, and the rows'
    empirical nucleus mass matches."""
    torch.manual_seed(1)
    vocab = 4000
    weights = (torch.randn(vocab) * 0.5).exp()
    ps = torch.tensor([0.9, 1.0, 0.2])
    n = 3000
    draws = ops.random_sample_top_p(weights.repeat(3 * n, 1), ps.repeat_interleave(n), {})
    for i, p in enumerate(ps.tolist()):
        expected = _nucleus(weights, p)
        row_draws = draws[i * n : (i + 1) * n]
        assert (expected[row_draws] > 0).all()
        # Most probable half of the nucleus (by mass) is drawn about half the time.
        order = expected.argsort(descending=True)
        top_half = order[: int((expected[order].cumsum(0) < 0.5).sum()) + 1]
        share = torch.isin(row_draws, top_half).double().mean().item()
        target = expected[top_half].sum().item()
        assert abs(share - target) < 4 * math.sqrt(target * (1 - target) / n)


def test_random_sample_top_p_seeded_rows_batch_independent():
    weights = (torch.randn(4, 500) * 0.5).exp()
    top_p = torch.tensor([0.5, 0.3, 0.9, 0.5])

    def draw(rows: list[int], seeds: dict[int, int]) -> list[list[int]]:
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        w = weights[rows]
        return [ops.random_sample_top_p(w.clone(), top_p[rows], gens).tolist() for _ in range(8)]

    alone = [d[0] for d in draw([3], {0: 11})]
    crowded = [d[2] for d in draw([0, 1, 3], {0: 5, 2: 11})]
    assert alone == crowded
    assert alone != [d[0] for d in draw([3], {0: 12})]


@pytest.mark.parametrize("vocab", [700, 512, 5])
def test_random_sample_across_chunks_and_a_partial_last_chunk(vocab):
    """The two-level draw: mass at chunk edges and in a partial last chunk is drawn in
    proportion, and zero-weight tokens (including at the very end) never are."""
    torch.manual_seed(3)
    ids = sorted({0, 1, vocab // 2, vocab - 2} | ({255, 256, 511} if vocab > 511 else set()))
    weights = torch.zeros(vocab)
    weights[ids] = torch.linspace(1.0, 3.0, len(ids))
    n = 20000
    draws = ops.random_sample(weights.repeat(n, 1), {})
    assert chi_square(draws, weights / weights.sum()) < CHI2_999[len(ids) - 1]


@pytest.mark.parametrize("vocab", [7, 511, 512, 700, 32000])
def test_argmax_matches_torch_including_ties_and_short_last_chunk(vocab):
    torch.manual_seed(4)
    logits = torch.randn(6, vocab)
    logits[1, -1] = 100.0  # the max in the (short) last chunk
    logits[2, :] = NEG_INF  # nothing allowed: index 0, like torch
    logits[3, [vocab // 3, vocab // 2, vocab - 1]] = 50.0  # ties: the first one wins
    logits[4] = logits[4].round()  # many ties everywhere
    assert ops.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert ops.argmax(logits)[3].item() == vocab // 3
