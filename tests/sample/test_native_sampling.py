"""The native draws (ops/csrc/sampling.h): `sample_rows`' one pass, the inverse CDF of
exp((logits - max) / T) for a given uniform, masked tokens never drawn, the distribution;
`sample_rows_truncated`'s rounds of top-k / top-p / min-p (`ops.native_random_sample`), the
nucleus law; and the sampler's use of both (the same tokens as its PyTorch draw for the same
seeded uniforms); greedy rows' `argmax_rows`."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import cpu_ops
from pagedllm.sample import ops
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from tests.sample.stats import CHI2_999, chi_square

native = cpu_ops()
pytestmark = pytest.mark.skipif(
    native is None or not native.cpu_has_avx2_fma(), reason="native sampling not built here"
)
NEG_INF = float("-inf")


def _reference(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor):
    """float64 cumulative weights [B, V] and each row's target u * total [B, 1]."""
    x = logits.double()
    cdf = ((x - x.amax(1, keepdim=True)) / temperature.double()[:, None]).exp().cumsum(1)
    return cdf, u.double()[:, None] * cdf[:, -1:]


@pytest.mark.parametrize("vocab", [512, 700, 49152])
def test_draw_is_the_inverse_cdf_of_the_tempered_softmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    u = torch.rand(rows, generator=g)
    tok = native.sample_rows(logits, temperature, u)
    cdf, target = _reference(logits, temperature, u)
    exact = torch.searchsorted(cdf, target, right=True).squeeze(1)
    assert (tok == exact).float().mean() >= 0.95
    # Where they differ, the target lies within fp32 rounding of the boundary between them.
    below = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    above = cdf.gather(1, tok[:, None]).squeeze(1)
    slack = 1e-5 * cdf[:, -1]
    assert ((below <= target.squeeze(1) + slack) & (target.squeeze(1) <= above + slack)).all()


def test_masked_tokens_are_never_drawn_and_greedy_rows_are_skipped():
    vocab = 1000
    kept = [0, 255, 256, 511, 700, 999]
    logits = torch.full((8, vocab), NEG_INF)
    logits[:, kept] = torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0])
    edges = [0.0, 1e-9, 0.3, 0.5, 0.9, 1.0 - 2**-24, 0.999999, 0.0]
    u = torch.tensor(edges)
    temperature = torch.ones(8)
    tok = native.sample_rows(logits, temperature, u)
    assert set(tok.tolist()) <= set(kept)
    assert tok[0].item() == 0 and tok[5].item() == 999  # the first / last token with weight
    # a row with no finite logit draws token 0; a row at temperature 0 is not drawn (0)
    logits[6] = NEG_INF
    temperature[7] = 0.0
    out = native.sample_rows(logits, temperature, torch.full((8,), 0.7))
    assert out[6].item() == 0 and out[7].item() == 0


def _metadata(params: list[SamplingParams], vocab: int, generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params, [[1, 2]] * n, [[]] * n, generators or [None] * n, vocab_size=vocab, device="cpu"
    )


def test_sampler_distribution_over_chunks():
    """Through the sampler: five tokens in three chunks (the last one partial), T = 0.7."""
    torch.manual_seed(7)
    vocab, n, temperature = 600, 20000, 0.7
    base = torch.full((vocab,), NEG_INF)
    tokens = [3, 255, 256, 511, 599]
    base[tokens] = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    logits = base.repeat(n, 1)
    metadata = _metadata([SamplingParams(temperature=temperature)] * n, vocab)
    assert ops.native_sampling(logits) is not None
    drawn = Sampler()(logits, metadata).sampled_token_ids
    expected = torch.softmax(base / temperature, dim=-1)
    assert chi_square(drawn, expected) < CHI2_999[4]


def test_sampler_native_draw_matches_its_pytorch_draw_and_keeps_greedy_rows(monkeypatch):
    """The same seeded uniforms through the native draw and the PyTorch one give the same
    tokens (but where a uniform falls within rounding of a boundary); greedy rows of the
    batch keep their argmax; the logits are left unchanged."""
    g = torch.Generator().manual_seed(3)
    rows, vocab = 48, 4096
    logits = torch.randn(rows, vocab, generator=g) * 2
    before = logits.clone()
    params = [SamplingParams(temperature=0.0 if i % 5 == 0 else 0.3 + i / 40) for i in range(rows)]

    def draw() -> torch.Tensor:
        generators = [torch.Generator().manual_seed(100 + i) for i in range(rows)]
        out = Sampler()(logits, _metadata(params, vocab, generators)).sampled_token_ids
        assert torch.equal(logits, before)
        return out

    assert ops.native_sampling(logits) is not None
    fused = draw()
    monkeypatch.setattr(ops, "native_sampling", lambda logits: None)
    plain = draw()
    assert (fused == plain).float().mean() >= 0.95
    greedy = logits.argmax(dim=-1)
    assert torch.equal(fused[::5], greedy[::5])


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 2048
    logits = torch.randn(6, vocab)
    params = [SamplingParams(temperature=0.9, seed=11 + i) for i in range(6)]
    gens = [torch.Generator().manual_seed(p.seed) for p in params]
    whole = Sampler()(logits, _metadata(params, vocab, gens)).sampled_token_ids
    gens = [torch.Generator().manual_seed(p.seed) for p in params[2:4]]
    part = Sampler()(logits[2:4].clone(), _metadata(params[2:4], vocab, gens)).sampled_token_ids
    assert torch.equal(part, whole[2:4])


def _nucleus(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference (float64): the nucleus-renormalized distribution, a token kept when the mass
    strictly more probable than it is < top_p (ties with the last kept one kept)."""
    probs = weights.double() / weights.double().sum()
    ahead = torch.stack([probs[probs > q].sum() for q in probs])
    kept = probs * (ahead < top_p) if top_p < 1.0 else probs
    return kept / kept.sum()


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.62, 0.95, 1.0])
def test_native_top_p_matches_the_nucleus_distribution(top_p):
    """Eight tokens with weight across three chunks of a 700-token row (the last chunk
    partial), a tie and the row's last token among them, the rest masked: the native rounds
    draw the nucleus' law."""
    torch.manual_seed(0)
    vocab, n = 700, 20000
    ids = [3, 255, 256, 300, 511, 512, 600, 699]
    weights = torch.tensor([3.0, 1.0, 2.5, 0.5, 2.0, 1.0, 0.125, 0.25])  # a tie at 1.0
    row = torch.full((vocab,), NEG_INF)
    row[ids] = weights.log() * 0.8  # at T = 0.8: weights exp(l / T) as above
    draws = ops.native_random_sample(
        native, row.repeat(n, 1), torch.full((n,), 0.8), {}, top_p=torch.full((n,), top_p)
    )
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[ids] = _nucleus(weights, top_p)
    assert set(draws.tolist()) <= set(expected.nonzero().flatten().tolist())
    assert chi_square(draws, expected) < CHI2_999[max(1, int((expected > 0).sum()) - 1)]


def _pytorch_draw(logits, temperature, generators, top_k=None, max_top_k=0, top_p=None, min_p=None):
    """The sampler's PyTorch draw on a copy: temperature, min-p, top-k, exp, then the top-p
    rounds or the plain inverse CDF."""
    x = ops.apply_temperature(logits.clone(), temperature)
    if min_p is not None:
        x = ops.apply_min_p(x, min_p)
    if top_k is not None:
        x = ops.apply_top_k(x, top_k, max_top_k)
    weights = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    if top_p is not None:
        return ops.random_sample_top_p(weights, top_p, generators), weights
    return ops.random_sample(weights, generators), weights


@pytest.mark.parametrize(
    "truncation",
    [
        {"top_p": [0.9, 1.0, 0.2, 0.5]},  # p = 0.2 takes several rounds on these flat rows
        {"top_k": [5, 4000, 40, 1]},
        {"min_p": [0.5, 0.0, 0.9, 0.2]},
        {"top_k": [40, 4000, 300, 2], "top_p": [0.3, 0.8, 1.0, 0.5], "min_p": [0.6, 0.1, 0.0, 0.0]},
    ],
    ids=["top_p", "top_k", "min_p", "all_three"],
)
def test_native_rounds_make_the_pytorch_draws(truncation):
    """Flat rows of a 4,000-token vocabulary (nuclei of thousands of tokens), each truncation
    off on some rows, greedy rows among them: with the same seeded generators the native rounds
    draw the tokens the PyTorch ops draw (but where rounding decides), never a token those ops
    mask or leave outside the nucleus, and a seeded row draws the same whatever shares its
    batch."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 36, 4000
    logits = torch.randn(rows, vocab, generator=g) * 0.5
    temperature = torch.full((rows,), 0.9)
    temperature[::9] = 0.0
    kwargs = {}
    for name, values in truncation.items():
        dtype = torch.int64 if name == "top_k" else torch.float32
        kwargs[name] = torch.tensor(values * (rows // 4), dtype=dtype)
    if "top_k" in kwargs:
        kwargs["max_top_k"] = max(k for k in truncation["top_k"] if k < vocab)

    def generators(seeds):
        return {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}

    seeds = [1000 + i for i in range(rows)]
    got = ops.native_random_sample(native, logits, temperature, generators(seeds), **kwargs)
    want, weights = _pytorch_draw(logits, temperature, generators(seeds), **kwargs)
    drawn = temperature > 0
    assert (got[drawn] == want[drawn]).float().mean() >= 0.95
    assert (got[~drawn] == 0).all()
    top_p = kwargs.get("top_p", torch.ones(rows))
    for r in drawn.nonzero().flatten().tolist():
        assert _nucleus(weights[r], top_p[r].item())[got[r]] > 0, r
    part = [3, 5, 6]
    alone = ops.native_random_sample(
        native,
        logits[part].clone(),
        temperature[part].clone(),
        generators([seeds[i] for i in part]),
        **{k: v[part].clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
    )
    assert torch.equal(alone, got[part])


def test_sampler_draws_truncations_natively_but_in_batch_invariant_mode(monkeypatch):
    """top-k / top-p / min-p rows, alone or together, take the native rounds and draw only kept
    tokens, the logits left unchanged; batch-invariant mode keeps the PyTorch draw; only fp32
    rows of two chunks or more go native."""
    vocab, n = 1024, 400
    logits = torch.randn(vocab).repeat(n, 1)
    before = logits.clone()
    row = logits[0]
    probs, order = torch.softmax(row, dim=-1).sort(descending=True)
    ahead = probs.cumsum(0) - probs  # mass before each token in order
    kept = {
        "top_k": set(order[:5].tolist()),
        "top_p": set(order[ahead < 0.05].tolist()),
        "min_p": set(
            (row >= row.max() + torch.log(torch.tensor(0.5))).nonzero().flatten().tolist()
        ),
    }
    calls = []
    rounds = ops.native_random_sample
    monkeypatch.setattr(
        ops, "native_random_sample", lambda *a, **k: calls.append(1) or rounds(*a, **k)
    )
    for name, value in (("top_k", 5), ("top_p", 0.05), ("min_p", 0.5)):
        metadata = _metadata([SamplingParams(**{name: value})] * n, vocab)
        drawn = set(Sampler()(logits, metadata).sampled_token_ids.tolist())
        assert drawn <= kept[name] and len(kept[name]) < 50, name
        assert calls.pop() and torch.equal(logits, before)
    both = _metadata([SamplingParams(top_k=5, top_p=0.05, min_p=0.5)] * n, vocab)
    drawn = set(Sampler()(logits, both).sampled_token_ids.tolist())
    assert drawn <= kept["top_k"] & kept["top_p"] & kept["min_p"] and calls.pop()

    def refuse(logits):
        raise AssertionError("batch-invariant mode must not take the native draw")

    monkeypatch.setattr(ops, "native_sampling", refuse)
    for params in (SamplingParams(temperature=1.0), SamplingParams(top_p=0.05)):
        Sampler(batch_invariant=True)(logits[:2], _metadata([params] * 2, vocab))
    monkeypatch.undo()
    assert ops.native_sampling(logits.bfloat16()) is None
    assert ops.native_sampling(logits[:, :511].contiguous()) is None


@pytest.mark.parametrize("vocab", [512, 700, 4099, 49152])
def test_native_top_k_floors_are_torch_topk_thresholds(vocab):
    """`top_k_floors` (and `ops.top_k_floor`, which takes it): each row's k-th largest logit
    as `torch.topk` gives it, repeats counted, for k from 1 to past the row's finite logits;
    -inf where k is V (off) or the row has fewer than k logits above -inf."""
    g = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[1] = (logits[1] * 2).round()  # many ties
    logits[2] = 0.5  # all equal
    logits[3, vocab // 3 :] = NEG_INF  # masked tokens (a grammar's): fewer than k left
    logits[4] = torch.arange(vocab, dtype=torch.float32)  # ascending: thr rises every segment
    logits[6, vocab // 3 :] = NEG_INF  # exactly k left
    ks = [1, 2, 5, vocab // 3 + 1, 50, 1000, vocab // 3, 20, vocab - 1, vocab, 7, 3000]
    top_k = torch.tensor([min(k, vocab) for k in ks])
    got = native.top_k_floors(logits, top_k)
    for r, k in enumerate(top_k.tolist()):
        want = logits[r].topk(k).values[-1].item() if k < vocab else NEG_INF
        assert got[r].item() == want, (r, k)
    max_top_k = max(k for k in top_k.tolist() if k < vocab)
    assert torch.equal(ops.top_k_floor(logits, top_k, max_top_k).squeeze(1), got)


@pytest.mark.parametrize("vocab", [1, 7, 16, 500, 49152, 49157])
def test_native_argmax_is_torch_argmax(vocab):
    """`argmax_rows` (and `ops.argmax`, which takes it for fp32 rows): the first index of the
    maximum, ties to the first, a NaN above every number, -inf rows to 0, any row length."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g)
    logits[1] = NEG_INF  # no finite logit
    logits[2] = (logits[2] * 4).round()  # ties
    logits[3, vocab // 2] = float("nan")
    logits[4, -1] = float("nan")  # a NaN in the tail after the maximum
    logits[4, 0] = 100.0
    logits[5, -1] = 1e9  # the maximum in the tail
    logits[6] = 0.0
    logits[6, vocab // 3 :] = -0.0  # zeros of both signs tie
    logits[7, : min(3, vocab)] = float("inf")
    expected = logits.argmax(dim=-1)
    assert torch.equal(native.argmax_rows(logits), expected)
    assert torch.equal(ops.argmax(logits), expected)
    # rows with a stride (a slice of a wider tensor), as an LM head's padded logits
    wide = torch.randn(12, vocab + 5, generator=g)
    assert torch.equal(ops.argmax(wide[:, :vocab]), wide[:, :vocab].argmax(dim=-1))


def _reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """(ids, logprobs, ranks) by log_softmax in float64: column 0 the token, then the top k
    by value, ties by index (rows of distinct values but for the tie test)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    ids, lps, ranks = [], [], []
    for i in range(logits.shape[0]):
        order = sorted(range(logits.shape[1]), key=lambda j: (-logits[i, j].item(), j))[:k]
        t = int(tokens[i])
        ids.append([t, *order])
        lps.append([lp[i, t].item(), *(lp[i, j].item() for j in order)])
        ranks.append(int((logits[i] > logits[i, t]).sum()) + 1)
    return torch.tensor(ids), torch.tensor(lps, dtype=torch.float64), torch.tensor(ranks)


@pytest.mark.parametrize("vocab", [37, 700, 4099])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_native_token_logprobs_are_log_softmax_gather_and_topk(vocab, k):
    g = torch.Generator().manual_seed(vocab + k)
    rows = 6
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[1, ::3] = NEG_INF  # masked tokens count for nothing
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    tokens[1] = 1  # a token the mask left
    ids, lps, ranks = native.token_logprobs(logits, tokens, k)
    want_ids, want_lps, want_ranks = _reference_logprobs(logits, tokens, k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(lps.double(), want_lps, rtol=0, atol=2e-5)


def test_native_token_logprobs_ties_and_short_rows():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0],  # three tokens tie for the top: by index
            [NEG_INF, 0.5, NEG_INF, NEG_INF, NEG_INF, NEG_INF],  # one token left of six
        ]
    )
    ids, lps, ranks = native.token_logprobs(logits, torch.tensor([4, 1]), 4)
    assert ids[0].tolist() == [4, 1, 2, 4, 5]
    assert ranks.tolist() == [1, 1]  # none strictly above either token
    assert ids[1, :2].tolist() == [1, 1] and lps[1, :2].tolist() == [0.0, 0.0]
    assert lps[1, 2:].tolist() == [NEG_INF] * 3  # fewer than k tokens left: -inf after them


def test_sampler_logprobs_come_from_the_raw_logits_natively():
    """The native logprobs read the logits after the draw, so the processors (here a
    penalty and a bias, in place on an fp32 input the caller hands over, or on the fp32 copy
    of a bf16 one) must not have touched them."""
    g = torch.Generator().manual_seed(3)
    vocab = 600
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(4, vocab, generator=g) * 3).to(dtype)
        raw = torch.log_softmax(logits.float(), dim=-1)
        params = [
            SamplingParams(
                temperature=0.0, logprobs=3, repetition_penalty=1.5, logit_bias={7: 30.0}
            )
        ] * 4
        metadata = SamplingMetadata.build(
            params, [[7, 8, 9]] * 4, [[1]] * 4, [None] * 4, vocab, "cpu"
        )
        out = Sampler()(logits.clone(), metadata, overwrite=True)
        assert out.sampled_token_ids.tolist() == [7] * 4
        top = raw.topk(3, dim=-1)
        assert torch.equal(out.logprobs.top_token_ids[:, 1:], top.indices)
        assert torch.allclose(out.logprobs.top_logprobs[:, 1:], top.values, atol=2e-5)
        assert torch.allclose(out.logprobs.top_logprobs[:, 0], raw[:, 7], atol=2e-5)
