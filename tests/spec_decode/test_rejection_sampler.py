"""RejectionSampler: greedy verification is exact, and sampling keeps the target distribution
(statistical tests over many trials on fixed p and q)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from pagedllm.spec_decode.verifier import build_row_metadata, verify_and_sample

V = 6


def _metadata(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, [[1]] * n, [[]] * n, generators or [None] * n, vocab_size=V, device="cpu"
    )


def _run(logits, params, drafts_flat, num_drafts, draft_probs=None, generators=None):
    return RejectionSampler()(
        logits,
        _metadata(params, generators),
        torch.tensor(drafts_flat, dtype=torch.int64),
        num_drafts,
        draft_probs,
    )


def test_greedy_accepts_the_matching_prefix_then_emits_the_argmax():
    # Row argmaxes: request 0 rows [3, 1, 4, 5]; request 1 rows [2, 0]; request 2 (no draft) [5].
    argmax = [3, 1, 4, 5, 2, 0, 5]
    logits = torch.full((7, V), -1.0)
    logits[torch.arange(7), torch.tensor(argmax)] = 2.0
    drafts = [3, 1, 0, 0, 2, 0, 0]  # req 0: 3, 1 match, 0 != 4; req 1: 2 matches (all)
    out = _run(logits, [SamplingParams(temperature=0.0)] * 7, drafts, [3, 1, 0])
    assert out.num_accepted.tolist() == [2, 1, 0]
    assert out.to_lists() == [[3, 1, 4], [2, 0], [5]]
    assert out.output_token_ids[2].tolist() == [5] + [PLACEHOLDER_TOKEN_ID] * 3


def _draw(probs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=gen)


def _tv(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * float((freq - probs.double()).abs().sum())


P = torch.tensor([0.05, 0.30, 0.10, 0.40, 0.15, 0.0])
Q_CASES = {
    "q_equals_p": P.clone(),
    "disjoint_q": torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]),
    "peaked_q": torch.tensor([0.97, 0.006, 0.006, 0.006, 0.006, 0.006]),
    "uniform_q": torch.full((V,), 1.0 / V),
}


@pytest.mark.parametrize("q_name", [*Q_CASES, "one_hot"])
def test_sampling_keeps_the_target_distribution(q_name):
    """Drafts d1, d2 ~ q; every emitted token (the first, and the second when the first draft
    was accepted) must be distributed as p."""
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(99)
    num_reqs, k = 30000, 2
    q = Q_CASES.get(q_name, Q_CASES["peaked_q"])
    logits = P.log().expand(num_reqs * (k + 1), V).clone()  # temperature 1 -> softmax == P
    drafts = _draw(q, num_reqs * (k + 1), gen)
    draft_probs = None if q_name == "one_hot" else q.expand(num_reqs * (k + 1), V)
    params = [SamplingParams(temperature=1.0)] * (num_reqs * (k + 1))
    out = _run(logits, params, drafts.tolist(), [k] * num_reqs, draft_probs)
    first = out.output_token_ids[:, 0]
    assert _tv(first, P) < 0.015
    has_second = out.num_accepted >= 1
    if bool(has_second.any()):
        # The expected TV of n draws from P is about 0.73 / sqrt(n); the accepted subset can
        # be a few thousand draws, so the bound scales with it (3x the expectation).
        n = int(has_second.sum())
        assert _tv(out.output_token_ids[has_second, 1], P) < max(0.02, 3 * 0.73 / n**0.5)
    if q_name == "q_equals_p":
        assert bool((out.num_accepted == k).all())  # p/q == 1: every draft is accepted
    if q_name == "disjoint_q":
        assert int(out.num_accepted.sum()) == 0  # p(d) == 0: every draft is rejected


def test_sampling_uses_the_processed_distribution():
    """p is the distribution after temperature and top-k, as the plain Sampler would use."""
    torch.manual_seed(7)
    num_reqs = 30000
    base = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0, 1.5])
    params = [SamplingParams(temperature=0.5, top_k=3)] * (2 * num_reqs)
    expected = torch.full((V,), float("-inf"))
    top = base.topk(3).indices
    expected[top] = base[top] / 0.5
    expected = expected.softmax(-1)
    drafts = torch.randint(0, V, (2 * num_reqs,))
    out = _run(base.expand(2 * num_reqs, V).clone(), params, drafts.tolist(), [1] * num_reqs)
    assert _tv(out.output_token_ids[:, 0], expected) < 0.015
    assert set(out.output_token_ids[:, 0].unique().tolist()) <= set(top.tolist())


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.0)] * 3
    argmax = logits.argmax(-1).tolist()
    drafts = [argmax[0], argmax[1], 0, 1, 2, 0]
    out = _run(logits, params, drafts, [2, 2])
    assert out.to_lists()[0] == argmax[:3]
    assert 1 <= len(out.to_lists()[1]) <= 3


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=1.0, seed=5)] * 3

    def run(extra_rows: int) -> list[int]:
        torch.manual_seed(extra_rows)  # the global RNG differs between runs
        lg = torch.cat([torch.randn(extra_rows, V), logits])
        ps = [SamplingParams(temperature=1.0)] * extra_rows + params
        gens = [None] * extra_rows + [torch.Generator().manual_seed(5)] * 3
        num = [0] * extra_rows + [2]
        out = _run(lg, ps, [0] * extra_rows + [1, 4, 0], num, generators=gens)
        return out.to_lists()[-1]

    assert run(0) == run(3) == run(5)


def test_row_metadata_sees_the_drafts_before_each_row():
    """A repetition penalty at draft position j must count drafts d_1..d_j as generated."""
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    meta = build_row_metadata(
        params, [[1]], [[2]], [None], [[3, 4]], vocab_size=V, device=torch.device("cpu")
    )
    seen = [set(row) for row in meta.repetition_token_ids.tolist()]
    assert seen == [{1, 2}, {1, 2, 3}, {1, 2, 3, 4}]


def test_verify_and_sample_applies_penalties_per_position():
    """Greedy with a strong repetition penalty: the draft repeating a token the previous draft
    just produced must be rejected, exactly as non-speculative decoding would."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 4.0, 0.0]] * 3)  # token 3 best, then 4
    params = [SamplingParams(temperature=0.0, repetition_penalty=10.0)]
    tokens, logprobs = verify_and_sample(
        logits, [[3, 3]], params, [[1]], [[2]], [None], RejectionSampler()
    )
    # Row 0 accepts 3; row 1 sees 3 already generated -> argmax becomes 4, rejecting d_2 = 3.
    assert tokens == [[3, 4]]
    assert logprobs is None


def test_logprobs_follow_the_emitted_tokens():
    logits = torch.log_softmax(torch.randn(3, V), -1)
    params = [SamplingParams(temperature=0.0, logprobs=2)]
    argmax = logits.argmax(-1).tolist()
    tokens, logprobs = verify_and_sample(
        logits, [[argmax[0], (argmax[1] + 1) % V]], params, [[1]], [[]], [None], RejectionSampler()
    )
    assert tokens == [[argmax[0], argmax[1]]]
    (lists,) = logprobs
    assert [row[0] for row in lists.token_ids] == tokens[0]
    assert lists.ranks == [1, 1]
    assert len(lists.token_ids[0]) == 3


def test_verify_and_sample_lays_out_each_requests_q():
    """Request 0 hands over q == p at its two draft rows (and a row it did not get to
    verify): its least likely drafts are still always accepted. Request 1 drafted by argmax
    (q one-hot) a token p all but forbids: always rejected. Request 2 has no draft."""
    torch.manual_seed(0)
    logits = torch.randn(3 + 2 + 1, V)
    logits[3, 0] = -40.0
    q0 = torch.cat([torch.softmax(logits[:2], dim=-1), torch.full((1, V), 1.0 / V)])
    drafts = [logits[:2].argmin(dim=-1).tolist(), [0], []]
    params = [SamplingParams(temperature=1.0)] * 3
    for _ in range(50):
        tokens, _ = verify_and_sample(
            logits, drafts, params, [[1]] * 3, [[]] * 3, [None] * 3, RejectionSampler(),
            [q0, None, None],
        )  # fmt: skip
        assert tokens[0][:2] == drafts[0] and len(tokens[0]) == 3
        assert len(tokens[1]) == 1 and tokens[1][0] != 0
        assert len(tokens[2]) == 1
