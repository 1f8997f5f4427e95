"""End to end through `LLM.generate`: greedy output is token-identical with and without
speculative decoding for every proposer, also under chunked prefill, prefix caching and
preemption; acceptance behaves as it must; seeded sampling stays reproducible."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.metrics import SpecDecodingRecorder

METHODS = ["ngram", "draft_model", "draft_is_target", "eagle", "medusa"]
MAX_NEW = 24
KV_BYTES = 16 << 20  # small: allocating the default 4 GiB cache costs seconds


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(10, 500) for _ in range(40)]  # a prefix-cache hit for three
    prompts = [shared + [rng.randrange(10, 500) for _ in range(n)] for n in (3, 17, 30)]
    prompts.append([rng.randrange(10, 500) for _ in range(9)])
    prompts.append([7, 8, 9, 10, 11] * 8)  # repetitive: n-gram lookup has something to copy
    return prompts


def _greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(llm: LLM, prompts, params=None) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params or _greedy(), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_llm(target_dir: str, spec_config: dict) -> LLM:
    return LLM(
        model=target_dir,
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        speculative_config=spec_config,
    )


def _scheduler(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _track_acceptance(llm: LLM) -> SpecDecodingRecorder:
    """Totals of the spec-decode stats the scheduler reports from now on."""
    recorder = SpecDecodingRecorder()
    llm.llm_engine.stat_loggers.append(recorder)
    return recorder


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    llm = LLM(
        model=target_dir, dtype="float32", kv_cache_memory=KV_BYTES, enable_prefix_caching=False
    )
    return _run(llm, _prompts())


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_token_identical(method, target_dir, spec_configs, reference):
    llm = _spec_llm(target_dir, spec_configs[method])
    totals = _track_acceptance(llm)
    assert _run(llm, _prompts()) == reference
    assert totals.num_drafts > 0
    if method == "draft_is_target":  # the target drafting for itself: every draft accepted
        assert totals.num_accepted_tokens == totals.num_draft_tokens
        assert totals.accepted_per_pos[0] == totals.num_drafts
    if method == "ngram":  # the repetitive prompt gets its drafts accepted
        assert totals.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_with_chunked_prefill_prefix_caching_and_preemption(
    method, target_dir, spec_configs, reference
):
    """A 24-token budget splits prompts over steps; 14 KV blocks for five requests of up to
    94 tokens force preemptions; the shared prefix hits the prefix cache."""
    llm = LLM(
        model=target_dir,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=24,
        num_gpu_blocks_override=14,
        enable_prefix_caching=True,
        speculative_config=spec_configs[method],
    )
    assert _run(llm, _prompts()) == reference
    assert _scheduler(llm).num_preemptions_total > 0
    _scheduler(llm).check_integrity()


def test_draft_model_identical_to_target_accepts_all_k(target_dir, spec_configs):
    llm = _spec_llm(target_dir, spec_configs["draft_is_target"])
    totals = _track_acceptance(llm)
    _run(llm, [_prompts()[0]], _greedy(max_tokens=41))  # 1 + 10 steps of 4 tokens
    assert totals.num_drafts == 10
    assert totals.num_accepted_tokens == totals.num_draft_tokens == 30
    assert totals.mean_acceptance_length == 4.0


def test_ngram_accepts_on_repetitive_text(target_dir, spec_configs):
    llm = _spec_llm(target_dir, spec_configs["ngram"])
    totals = _track_acceptance(llm)
    _run(llm, [[7, 8, 9, 10, 11] * 8], _greedy(max_tokens=64))
    assert totals.num_accepted_tokens / totals.num_drafts > 0


def test_sampled_drafts_from_the_target_itself_are_accepted(target_dir, spec_configs):
    """At temperature 1 the draft model samples its drafts and hands over q; drafting with
    the target's own weights makes q == p (up to rounding), so min(1, p / q) accepts all."""
    llm = _spec_llm(target_dir, spec_configs["draft_is_target"])
    totals = _track_acceptance(llm)
    params = SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True)
    outs = _run(llm, _prompts(), [params] * len(_prompts()))
    assert all(len(t) == 120 for t in outs)
    assert totals.num_draft_tokens >= 300
    assert totals.num_accepted_tokens / totals.num_draft_tokens > 0.95


@pytest.mark.parametrize("method", ["ngram", "draft_is_target", "draft_model", "eagle"])
def test_seeded_sampling_is_reproducible(method, target_dir, spec_configs):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True)
        for s in (1, 2)
    ]
    prompts = _prompts()[-2:]
    llm = _spec_llm(target_dir, spec_configs[method])
    first = _run(llm, prompts, params)
    again = _run(llm, prompts, params)
    other = _run(
        _spec_llm(target_dir, spec_configs[method]),
        prompts[::-1],
        params[::-1],
    )[::-1]
    assert first == again == other
    assert all(len(t) == 20 for t in first)


def test_n_greater_than_one_and_mixed_batches(target_dir, spec_configs, reference):
    llm = _spec_llm(target_dir, spec_configs["draft_model"])
    prompts = _prompts()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]],
        [
            _greedy(n=2),
            SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=MAX_NEW, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [list(c.token_ids) for c in outs[0].outputs] == [reference[0]] * 2
    assert len(outs[1].outputs) == 3
    assert all(len(c.token_ids) == MAX_NEW for c in outs[1].outputs)


def test_logprobs_with_drafts(target_dir, spec_configs):
    plain = LLM(model=target_dir, dtype="float32", kv_cache_memory=KV_BYTES)
    spec = _spec_llm(target_dir, spec_configs["draft_is_target"])
    prompts = [{"prompt_token_ids": _prompts()[3]}]
    params = _greedy(max_tokens=9, logprobs=2)
    (a,) = plain.generate(prompts, params, use_tqdm=False)
    (b,) = spec.generate(prompts, params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(b.outputs[0].logprobs) == 9
    for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert lp_a.keys() == lp_b.keys()
        for tok in lp_a:
            assert lp_a[tok].logprob == pytest.approx(lp_b[tok].logprob, abs=1e-4)


def test_structured_outputs_next_to_speculating_requests(target_dir, spec_configs, reference):
    """A structured request speculates next to unconstrained ones (their rows unmasked), all
    token-identical to plain greedy (tests/spec_decode/test_structured_outputs.py has more)."""
    import re

    from pagedllm import StructuredOutputsParams

    llm = _spec_llm(target_dir, spec_configs["draft_is_target"])
    totals = _track_acceptance(llm)
    prompts = _prompts()
    regex = r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)"
    structured = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3]],
        [_greedy(), structured, _greedy()],
        use_tqdm=False,
    )
    assert list(outs[0].outputs[0].token_ids) == reference[0]
    assert list(outs[2].outputs[0].token_ids) == reference[2]
    # Checked on the tokens: a random prompt may end inside a UTF-8 sequence, which the
    # detokenizer then prepends to the first output text.
    assert re.fullmatch(
        regex, llm.get_tokenizer().decode(outs[1].outputs[0].token_ids, skip_special_tokens=True)
    )
    assert totals.num_drafts > 0
