"""The Sampler end to end: SamplingParams -> SamplingMetadata.build -> Sampler.forward."""

import math

import pytest
import torch

from pagedllm.sample.logprobs import compute_token_logprobs
from pagedllm.sample.metadata import SamplingMetadata, TokenHistory
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from tests.sample.stats import CHI2_999, chi_square

V = 32
EOS = 0


def _params(eos: int | None = None, **kwargs) -> SamplingParams:
    params = SamplingParams(**kwargs)
    if eos is not None:
        params.update_from_generation_config({}, [eos])
    return params


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
):
    n = len(params)
    metadata = SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[1, 2, 3]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        vocab_size=logits.shape[1],
        device="cpu",
    )
    return Sampler()(logits, metadata), metadata


def _seeded_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def test_greedy_is_argmax():
    logits = torch.randn(8, V)
    out, metadata = _sample(logits, [_params(temperature=0.0) for _ in range(8)])
    assert metadata.all_greedy and metadata.temperature is None and metadata.top_k is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_input_logits_unchanged():
    logits = torch.randn(4, V)
    before = logits.clone()
    params = [_params(temperature=0.8, top_p=0.5, logit_bias={3: 5.0}, presence_penalty=1.0)] * 4
    _sample(logits, params, outputs=[[1, 2]] * 4)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.7},
        {"temperature": 0.9, "top_p": 0.6, "top_k": 20, "presence_penalty": 0.5},
    ],
)
def test_overwrite_gives_the_same_tokens(kwargs):
    """Handing the logits over (`overwrite=True`, the runner's call) changes nothing but the
    copy: seeded draws are identical."""
    logits = torch.randn(3, V)
    results = []
    for overwrite in (False, True):
        params = [_params(seed=5, **kwargs)] * 3
        metadata = SamplingMetadata.build(
            params, [[1, 2]] * 3, [[4]] * 3, [_seeded_gen(i) for i in range(3)], V, "cpu"
        )
        out = Sampler()(logits.clone(), metadata, overwrite=overwrite)
        results.append(out.sampled_token_ids.tolist())
    assert results[0] == results[1]


def test_bf16_logits():
    logits = torch.randn(4, V).to(torch.bfloat16)
    out, _ = _sample(logits, [_params(temperature=0.0), _params(temperature=1.0)] * 2)
    assert out.sampled_token_ids[0] == logits[0].float().argmax()


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, V)
    out, _ = _sample(logits, [_params(temperature=1.5, top_k=1) for _ in range(16)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_batch():
    logits = torch.zeros(400, V)
    logits[:, 5] = 1.0  # argmax, but far from certain when sampled
    params = [_params(temperature=0.0 if i % 2 else 1.0) for i in range(400)]
    out, metadata = _sample(logits, params)
    assert not metadata.all_greedy and not metadata.all_random
    tokens = out.sampled_token_ids
    assert (tokens[1::2] == 5).all()
    assert (tokens[0::2] != 5).any()


def test_seeded_sampling_reproducible_and_batch_independent():
    logits = torch.randn(1, V)
    seeded = _params(temperature=1.0, seed=42)

    def run(rows: list[tuple[torch.Tensor, SamplingParams, torch.Generator | None]], steps=6):
        gens = [g for _, _, g in rows]
        batch = torch.cat([lg for lg, _, _ in rows])
        return [
            _sample(batch, [p for _, p, _ in rows], generators=gens)[0].sampled_token_ids.tolist()
            for _ in range(steps)
        ]

    alone = [step[0] for step in run([(logits, seeded, _seeded_gen(42))])]
    again = [step[0] for step in run([(logits, seeded, _seeded_gen(42))])]
    assert alone == again

    # Same request at row 2 of a bigger batch with unseeded and other seeded rows.
    crowd = run(
        [
            (torch.randn(1, V), _params(temperature=1.0), None),
            (torch.randn(1, V), _params(temperature=0.7, seed=1), _seeded_gen(1)),
            (logits, seeded, _seeded_gen(42)),
            (torch.randn(1, V), _params(temperature=0.0), None),
        ]
    )
    assert [step[2] for step in crowd] == alone

    other_seed = [step[0] for step in run([(logits, seeded, _seeded_gen(43))])]
    assert other_seed != alone


def test_distribution_matches_softmax_over_temperature():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.7
    n = 20000
    out, _ = _sample(base.repeat(n, 1), [_params(temperature=temperature)] * n)
    expected = torch.softmax(base / temperature, dim=-1)
    assert chi_square(out.sampled_token_ids, expected) < CHI2_999[5]


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        # mass ahead: 0, .4, .7, .9, .96 -> top_p=.85 keeps the first three
        ({"top_p": 0.85}, [0, 1, 2]),
        # min_p=.3 -> threshold .12: keeps .4, .3, .2
        ({"min_p": 0.3}, [0, 1, 2]),
        ({"top_k": 2}, [0, 1]),
        # top_k=4 then top_p on the renormalized (.4, .3, .2, .06)/.96 -> mass ahead of the
        # fourth is .9/.96 = .9375 >= .9
        ({"top_k": 4, "top_p": 0.9}, [0, 1, 2]),
    ],
)
def test_truncation_draws_only_kept_tokens(kwargs, kept):
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]
    n = 20000
    out, _ = _sample(_probs_logits(probs).repeat(n, 1), [_params(**kwargs)] * n)
    expected = torch.zeros(len(probs))
    expected[kept] = torch.tensor([probs[i] for i in kept])
    expected /= expected.sum()
    assert chi_square(out.sampled_token_ids, expected) < CHI2_999[len(kept) - 1]


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.zeros(2, V)
    logits[:, 7] = 3.0
    logits[:, 8] = 2.0
    params = [_params(temperature=0.0, repetition_penalty=2.0), _params(temperature=0.0)]
    out, metadata = _sample(logits, params, prompts=[[7, 3], [7]], outputs=[[3, 3], []])
    assert sorted(metadata.repetition_token_ids[0].tolist()) == [3, 7]
    assert metadata.repetition_token_ids[1].tolist() == [0, 0]
    assert metadata.output_token_counts is None  # no frequency / presence penalty
    assert out.sampled_token_ids.tolist() == [8, 7]  # 3 / 2 < 2 for the penalized row


def test_frequency_and_presence_penalties():
    logits = torch.zeros(2, V)
    logits[:, 7] = 3.0
    logits[:, 8] = 2.5
    params = [
        _params(temperature=0.0, frequency_penalty=0.3),  # 3 - 2 * 0.3 = 2.4 < 2.5
        _params(temperature=0.0, presence_penalty=0.4),  # 3 - 0.4 = 2.6 > 2.5
    ]
    out, metadata = _sample(logits, params, outputs=[[7, 7], [7, 9, 7]])
    assert metadata.repetition_token_ids is None  # only repetition needs the prompt
    assert metadata.output_token_ids.tolist() == [[7, 0], [7, 9]]
    assert metadata.output_token_counts.tolist() == [[2, 0], [2, 1]]
    assert out.sampled_token_ids.tolist() == [8, 7]


def test_penalties_match_naive_reference():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, V, generator=gen) * 2
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (3, 8, 1, 5, 2, 4)]
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (0, 9, 4, 12, 1, 6)]
    settings = [(1.3, 0.2, 0.1), (0.8, -0.4, 0.5), (1.0, 1.0, 0.0), (1.0, 0.0, 0.0), (2.0, 0, 0)]
    settings.append((1.0, 0.0, -1.5))
    params = [
        _params(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for r, f, p in settings
    ]
    metadata = SamplingMetadata.build(params, prompts, outputs, [None] * 6, V, "cpu")
    got = Sampler.apply_logits_processors(logits.clone(), metadata)

    expected = logits.clone()
    for i, (rep, freq, pres) in enumerate(settings):
        for tok in set(prompts[i]) | set(outputs[i]):
            x = expected[i, tok]
            expected[i, tok] = x / rep if x > 0 else x * rep
        for tok in set(outputs[i]):
            expected[i, tok] -= freq * outputs[i].count(tok) + pres
    assert torch.allclose(got, expected, atol=1e-6)


def _naive_penalties(logits, params, prompts, outputs):
    expected = logits.clone()
    for i, p in enumerate(params):
        for tok in set(prompts[i]) | set(outputs[i]):
            x = expected[i, tok]
            expected[i, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(outputs[i]):
            count = outputs[i].count(tok)
            expected[i, tok] -= p.frequency_penalty * count + p.presence_penalty
    return expected


def test_token_histories_follow_growing_outputs():
    """Histories kept across steps (as the model runner keeps one a request) give the
    penalties of each step's whole history: tokens appended one or many at a time, a first
    history of many tokens at once, tokens the prompt has and lacks, repeats, and an output
    that got shorter (which starts the history over)."""
    gen = torch.Generator().manual_seed(7)
    vocab = 64
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 30, 5, 12)]
    outputs = [[], torch.randint(0, vocab, (40,), generator=gen).tolist(), [], [3]]
    params = [
        _params(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2),
        _params(repetition_penalty=0.7),
        _params(frequency_penalty=-0.5, presence_penalty=1.0),
        _params(repetition_penalty=1.2, presence_penalty=0.4),
    ]
    histories = [TokenHistory(p) for p in prompts]
    for step in range(30):
        logits = torch.randn(4, vocab, generator=gen) * 3
        metadata = SamplingMetadata.build(
            params, prompts, outputs, [None] * 4, vocab, "cpu", histories=histories
        )
        got = Sampler.apply_logits_processors(logits.clone(), metadata)
        expected = _naive_penalties(logits, params, prompts, outputs)
        assert torch.allclose(got, expected, atol=1e-5), step
        for i in range(4):
            n = int(torch.randint(1, 20 if step % 5 == 0 else 3, (1,), generator=gen))
            outputs[i] = outputs[i] + torch.randint(0, vocab, (n,), generator=gen).tolist()
        if step == 20:
            outputs[1] = outputs[1][:3]  # shorter than folded: starts over


def test_a_rewritten_output_gets_a_new_history():
    from pagedllm.worker.model_runner import CachedRequestState

    state = CachedRequestState("r", [1, 2], [5, 6, 7], _params(repetition_penalty=2.0), [0], 0)
    assert state.history.seen(state.output_token_ids).tolist() == [1, 2, 5, 6, 7]
    kept = state.history
    state.set_tokens(4, [7, 8])  # the tokens it holds, then a new one: an append
    assert state.history is kept
    assert sorted(state.history.seen(state.output_token_ids).tolist()) == [1, 2, 5, 6, 7, 8]
    state.set_tokens(3, [9])  # output 6 rewritten to 9 (a beam's continuation)
    assert state.output_token_ids == [5, 9, 7, 8]
    assert sorted(state.history.seen(state.output_token_ids).tolist()) == [1, 2, 5, 7, 8, 9]


def test_logit_bias():
    logits = torch.zeros(2, V)
    logits[:, 3] = 1.0
    params = [_params(temperature=0.0, logit_bias={9: 2.0}), _params(temperature=0.0)]
    out, _ = _sample(logits, params)
    assert out.sampled_token_ids.tolist() == [9, 3]


def test_allowed_token_ids():
    logits = torch.randn(300, V)
    allowed = [4, 11, 20]
    params = (
        [_params(temperature=0.0, allowed_token_ids=allowed)]
        + [_params(temperature=2.0, allowed_token_ids=allowed)] * 298
        + [_params(temperature=0.0)]
    )
    out, _ = _sample(logits, params)
    tokens = out.sampled_token_ids
    assert tokens[0] == allowed[int(logits[0, allowed].argmax())]
    assert set(tokens[1:-1].tolist()) <= set(allowed)
    assert tokens[-1] == logits[-1].argmax()


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(4, V)
    logits[:, EOS] = 5.0
    logits[:, 9] = 4.0
    logits[:, 1] = 3.0
    params = [_params(eos=EOS, temperature=0.0, min_tokens=3, stop_token_ids=[9])] * 4
    params[3] = _params(eos=EOS, temperature=0.0, min_tokens=3, ignore_eos=True)
    out, _ = _sample(logits, params, outputs=[[5], [5, 5], [5, 5, 5], [5]])
    # Rows 0-1 are still short: EOS and stop id 9 are masked. Row 2 reached min_tokens.
    # Row 3 ignores EOS, so EOS is not a stop token to hold back.
    assert out.sampled_token_ids.tolist() == [1, 1, EOS, EOS]


def test_bad_words():
    logits = torch.zeros(3, V)
    logits[:, 8] = 3.0
    logits[:, 5] = 2.0
    params = _params(temperature=0.0, bad_words=["x"])
    params._bad_words_token_ids = [[5], [7, 8]]  # as update_from_tokenizer would set
    out, _ = _sample(logits, [params] * 3, outputs=[[7], [1, 7], [7, 1]])
    # Rows ending in 7 must not continue with 8; 5 is banned everywhere.
    assert out.sampled_token_ids.tolist() == [0, 0, 8]


def test_logprobs_are_raw_and_sampled_token_first():
    logits = torch.randn(3, V)
    params = [
        _params(temperature=0.0, logprobs=2, logit_bias={4: 50.0}),
        _params(temperature=0.9, logprobs=0),
        _params(temperature=0.0),
    ]
    out, metadata = _sample(logits, params)
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert metadata.max_num_logprobs == 2 and lp.top_token_ids.shape == (3, 3)
    assert torch.equal(lp.top_token_ids[:, 0], out.sampled_token_ids)
    assert out.sampled_token_ids[0] == 4  # the bias picks the token, not the logprobs
    picked = raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    assert torch.allclose(lp.top_logprobs[:, 0], picked)
    assert lp.sampled_rank.tolist() == [int((raw[i] > picked[i]).sum()) + 1 for i in range(3)]
    top2 = raw.topk(2, dim=-1)
    assert torch.equal(lp.top_token_ids[:, 1:], top2.indices)
    assert torch.allclose(lp.top_logprobs[:, 1:], top2.values)

    lists = lp.to_lists(metadata.num_logprobs)
    assert lists[2] is None
    assert len(lists[0].token_ids[0]) == 3 and len(lists[1].token_ids[0]) == 1
    assert lists[1].token_ids == [[int(out.sampled_token_ids[1])]]
    assert lists[0].ranks == [int(lp.sampled_rank[0])]


def test_compute_token_logprobs_rank():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    lp = compute_token_logprobs(logits, torch.tensor([2, 0]), num_logprobs=1)
    assert lp.top_token_ids.tolist() == [[2, 1], [0, 0]]
    assert lp.sampled_rank.tolist() == [3, 1]
    assert torch.allclose(lp.top_logprobs[:, 0], torch.log_softmax(logits, -1)[[0, 1], [2, 0]])
    combined = lp.tolists()
    assert combined.ranks == [3, 1] and combined.token_ids == [[2, 1], [0, 0]]


def test_builder_makes_only_needed_tensors():
    plain = [_params(temperature=1.0), _params(temperature=0.5)]
    metadata = SamplingMetadata.build(plain, [[1]] * 2, [[2]] * 2, [None] * 2, V, "cpu")
    assert metadata.all_random and metadata.temperature is not None
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties and metadata.output_token_ids is None
    assert metadata.repetition_token_ids is None
    assert metadata.logit_bias is None and metadata.allowed_token_ids is None
    assert metadata.banned_token_ids is None and metadata.max_num_logprobs is None

    # Frequency penalty before the first output token: nothing to penalize yet.
    first_step = [_params(frequency_penalty=1.0)]
    metadata = SamplingMetadata.build(first_step, [[1]], [[]], [None], V, "cpu")
    assert metadata.no_penalties and metadata.output_token_counts is None

    mixed = [_params(temperature=0.0, seed=3), _params(temperature=1.0, top_k=4, seed=5)]
    gens = [_seeded_gen(3), _seeded_gen(5)]
    metadata = SamplingMetadata.build(mixed, [[1]] * 2, [[2]] * 2, gens, V, "cpu")
    assert metadata.top_k.tolist() == [V, 4] and metadata.max_top_k == 4
    assert list(metadata.generators) == [1]  # greedy rows never consume their generator

    out_of_vocab = [_params(logit_bias={V + 5: 1.0, 2: 1.0}, allowed_token_ids=[1, V + 1])]
    metadata = SamplingMetadata.build(out_of_vocab, [[1]], [[]], [None], V, "cpu")
    assert metadata.logit_bias[1].tolist() == [2]
    rows, mask = metadata.allowed_token_ids
    assert rows.tolist() == [0] and (mask == 0).nonzero().tolist() == [[0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "reusable"),
    [
        ({}, True),
        ({"temperature": 0.8, "top_p": 0.9, "logit_bias": {3: 1.0}, "seed": 1}, True),
        ({"presence_penalty": 0.5}, False),
        ({"repetition_penalty": 1.2}, False),
        ({"min_tokens": 2}, False),
    ],
)
def test_metadata_reusable_only_when_independent_of_outputs(kwargs, reusable):
    plain = _params()
    _, metadata = _sample(torch.randn(2, V), [plain, _params(**kwargs)])
    assert metadata.reusable is reusable


def test_runner_reuses_metadata_for_the_same_request_states(tiny_llama_dir, make_engine_config):
    from pagedllm.worker.model_runner import CachedRequestState, ModelRunner

    runner = ModelRunner(make_engine_config(tiny_llama_dir), torch.device("cpu"))

    def state(req_id: str, **kwargs) -> CachedRequestState:
        return CachedRequestState(req_id, [1, 2], [], _params(**kwargs), [0], 0)

    a, b = state("a", temperature=0.5), state("b")
    first = runner._sampling_metadata([a, b], V)
    assert runner._sampling_metadata([a, b], V) is first
    assert runner._sampling_metadata([a], V) is not first  # other rows
    again = runner._sampling_metadata([a, state("b")], V)  # b resumed: a new state
    assert again is not first
    penalized = [a, state("c", frequency_penalty=1.0)]
    assert runner._sampling_metadata(penalized, V) is not runner._sampling_metadata(penalized, V)
