"""Batch-invariant mode: a request's tokens and logprobs are bitwise the same alone and inside
random batches (greedy and seeded sampling, chunked prefill and prefix caching on, requests
arriving mid-way); without the mode the same harness finds a difference. Plus the pieces:
`det_exp`, row-by-row GEMMs, and the configurations the mode refuses."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.batch_invariant import BATCH_INVARIANT_ENV, det_exp, linear_by_rows
from pagedllm.sampling_params import SamplingParams

VOCAB = 500  # the tiny checkpoint's 512, minus a margin for special tokens


def test_det_exp_is_exp_and_ignores_the_element_position():
    x = torch.cat([torch.linspace(-110, 80, 4001), torch.tensor([float("-inf"), 0.0])])
    ref = torch.exp(x.double()).float()
    got = det_exp(x)
    assert torch.equal(got[-2:], torch.tensor([0.0, 1.0]))
    # Within an ulp or two of the float64 exp rounded to float32.
    finite = ref > 0
    rel = ((got[finite].double() - ref[finite].double()).abs() / ref[finite].double()).max()
    assert rel < 3e-7
    # The same value anywhere: at every offset of a longer tensor, in every shape.
    for offset in (0, 1, 7, 13, 31):
        padded = torch.cat([torch.zeros(offset), x, torch.zeros(5)])
        assert torch.equal(det_exp(padded)[offset : offset + len(x)], got)
    assert torch.equal(det_exp(x[:-2].view(-1, 1)).view(-1), got[:-2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_by_rows_gives_each_row_its_batch_of_one_bits(dtype):
    torch.manual_seed(0)
    weight = torch.randn(96, 200, dtype=dtype)
    rows = torch.randn(70, 200, dtype=dtype)

    def linear(x):
        return torch.nn.functional.linear(x, weight)

    batched = linear_by_rows(linear, rows)
    for i in (0, 1, 33, 69):
        assert torch.equal(batched[i], linear_by_rows(linear, rows[i : i + 1])[0])
        start = max(0, i - 2)
        assert torch.equal(batched[i], linear_by_rows(linear, rows[start : i + 3])[i - start])


def _engine(model_dir: str, batch_invariant: bool, dtype: str, kv_cache_dtype: str):
    from pagedllm.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model_dir,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        device="cpu",
        batch_invariant=batch_invariant,
        max_num_seqs=64,
        max_num_batched_tokens=64,  # long prompts are chunked, differently in every batch
        enable_prefix_caching=True,
        max_model_len=256,
        kv_cache_memory_bytes=128 << 10,  # 256 tokens: big batches preempt (recompute)
        seed=0,
    )
    return LLMEngine.from_engine_args(args)


def _signature(output) -> tuple:
    """Tokens and logprobs, floats as their exact bits (hex)."""
    completion = output.outputs[0]
    logprobs = tuple(
        tuple(sorted((tok, lp.logprob.hex(), lp.rank) for tok, lp in step.items()))
        for step in completion.logprobs or ()
    )
    return tuple(completion.token_ids), logprobs


def _run(engine, requests: list[tuple[int, str, dict, SamplingParams]]) -> dict[str, tuple]:
    """Add each (step, id, prompt, params) at its engine step; run to the end; signatures
    of the finished requests by id."""
    pending = sorted(requests, key=lambda r: r[0])
    results: dict[str, tuple] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = _signature(out)
        step += 1
    return results


def _targets(rng: random.Random) -> list[tuple[str, dict, SamplingParams]]:
    prompts = [[rng.randrange(5, VOCAB) for _ in range(n)] for n in (5, 37, 90)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=3)
    return [
        (f"target-{i}-{kind}", {"prompt_token_ids": p}, params)
        for i, p in enumerate(prompts)
        for kind, params in (("greedy", greedy), ("seeded", seeded))
    ]


def _other(rng: random.Random, shared_prefix: list[int], k: int):
    if rng.random() < 0.25:  # a prefix-cache hit (or a shared block in the same step)
        ids = shared_prefix[: rng.randrange(16, len(shared_prefix))]
    else:
        ids = []
    ids = ids + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 60))]
    temperature = rng.choice([0.0, 0.7, 1.0])
    params = SamplingParams(
        temperature=temperature,
        seed=rng.choice([None, k]) if temperature else None,
        max_tokens=rng.randrange(1, 12),
        logprobs=rng.choice([None, 2]),
    )
    return f"other-{k}", {"prompt_token_ids": ids}, params


def _differences(
    model_dir: str,
    batch_invariant: bool,
    trials: int,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
) -> list[str]:
    """Each target alone, then inside `trials` random batches of 1-64 other requests
    arriving over the first steps (targets too); the targets whose output changed."""
    rng = random.Random(1234)
    engine = _engine(model_dir, batch_invariant, dtype, kv_cache_dtype)
    try:
        targets = _targets(rng)
        alone = {}
        for rid, prompt, params in targets:
            alone.update(_run(engine, [(0, rid, prompt, params)]))
        shared = targets[-1][1]["prompt_token_ids"]
        changed = []
        for trial in range(trials):
            others = [_other(rng, shared, k) for k in range(rng.randrange(1, 65))]
            batch = [(rng.randrange(0, 6), f"{rid}#{trial}", p, sp) for rid, p, sp in others]
            batch += [(rng.randrange(0, 6), f"{rid}#{trial}", p, sp) for rid, p, sp in targets]
            results = _run(engine, batch)
            for rid, _, _ in targets:
                if results[f"{rid}#{trial}"] != alone[rid]:
                    changed.append(f"{rid}#{trial}")
        return changed
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, kv_cache_dtype, trials",
    [("float32", "auto", 12), ("bfloat16", "auto", 3), ("float32", "fp8", 3)],
)
def test_outputs_are_bitwise_identical_alone_and_in_any_batch(
    tiny_llama_dir, dtype, kv_cache_dtype, trials
):
    changed = _differences(tiny_llama_dir, True, trials, dtype, kv_cache_dtype)
    assert changed == []


@pytest.mark.slow
def test_without_the_mode_batches_change_logprobs(tiny_llama_dir):
    """What the mode removes: on the default path (oneDNN GEMMs picked by row count, padded
    and grouped attention, decode vs prefill kernels) the same harness sees outputs change."""
    assert _differences(tiny_llama_dir, batch_invariant=False, trials=3)


def test_env_var_turns_the_mode_on(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    config = EngineArgs(model=tiny_llama_dir, device="cpu").create_engine_config()
    assert config.batch_invariant
    monkeypatch.delenv(BATCH_INVARIANT_ENV)
    assert not EngineArgs(model=tiny_llama_dir, device="cpu").create_engine_config().batch_invariant


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"compilation_config": {"level": 3}}, "compilation_config"),
        ({"attention_backend": "TORCH_SDPA"}, "attention_backend"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_what_the_mode_cannot_vouch_for_is_refused(tiny_llama_dir, kwargs, field):
    args = EngineArgs(model=tiny_llama_dir, device="cpu", batch_invariant=True, **kwargs)
    with pytest.raises(ValueError, match=f"batch_invariant=True cannot be combined with {field}"):
        args.create_engine_config()


def _attend_steps(
    backend, steps, qkv, cache_dtype=torch.float32, num_blocks=32, block_size=16, kv_scales=None
):
    """Run `steps` (each a list of (request, first position, rows)) through `backend` over
    one cache of `cache_dtype` (an fp8 one with `kv_scales`, if given); request r's tokens
    are `qkv[r]` = (q, k, v) [n, H(kv), D] and its blocks are r * 8 ... . Returns
    {(request, position): output row [H, D]}."""
    from pagedllm.attention.backend import CommonAttentionMetadata
    from pagedllm.attention.fp8_kv import UNIT_SCALES

    h_kv, d = qkv[0][1].shape[1:]
    shape = backend.get_kv_cache_shape(num_blocks, block_size, h_kv, d)
    cache = torch.zeros(shape, dtype=cache_dtype)
    table = torch.arange(num_blocks, dtype=torch.int32).view(-1, 8).numpy()
    rows = {}
    for step in steps:
        reqs = [r for r, _, _ in step]
        first = torch.tensor([p for _, p, _ in step]).numpy()
        counts = torch.tensor([n for _, _, n in step]).numpy()
        common, positions = CommonAttentionMetadata.for_spans(
            table[reqs], first, counts, block_size, torch.device("cpu")
        )
        pick = [(r, int(p)) for r, p0, n in step for p in range(p0, p0 + n)]
        q, k, v = (torch.stack([qkv[r][i][p] for r, p in pick]) for i in range(3))
        meta = backend.build_metadata(common)
        out = backend.forward(q, k, v, cache, meta, 0.25, kv_scales or UNIT_SCALES)
        rows.update({rp: out[i] for i, rp in enumerate(pick)})
    return rows


@pytest.mark.parametrize(
    "invariant, cache_dtype, scaled",
    [
        (True, torch.float32, False),
        (False, torch.float32, False),
        (True, torch.float8_e4m3fn, False),
        (True, torch.float8_e4m3fn, True),  # calculate_kv_scales-like scales
    ],
)
def test_attention_row_is_the_same_in_prefill_chunks_decodes_and_batches(
    invariant, cache_dtype, scaled
):
    """One request's row 39 computed four ways: a 40-token prefill; chunks of 24 + 16; a
    decode after 39 prefilled; that decode batched with two others of other lengths (and a
    prefill). The mode's backend gives one answer, over an fp8 cache too (with scales too);
    the default torch backend does not."""
    from pagedllm.attention.batch_invariant_backend import BatchInvariantAttentionBackend
    from pagedllm.attention.fp8_kv import KVScales
    from pagedllm.attention.torch_backend import TorchAttentionBackend

    scales = KVScales(0.0371, 2.6) if scaled else None

    torch.manual_seed(0)
    qkv = [
        (torch.randn(64, 4, 16), torch.randn(64, 2, 16), torch.randn(64, 2, 16)) for _ in range(4)
    ]
    backend = BatchInvariantAttentionBackend() if invariant else TorchAttentionBackend()
    ways = [
        [[(0, 0, 40)]],
        [[(0, 0, 24)], [(0, 24, 16)]],
        [[(0, 0, 39)], [(0, 39, 1)]],
        [[(0, 0, 39), (1, 0, 61), (2, 0, 5)], [(2, 5, 1), (0, 39, 1), (1, 61, 1), (3, 0, 30)]],
    ]
    results = [
        _attend_steps(backend, steps, qkv, cache_dtype, kv_scales=scales)[(0, 39)] for steps in ways
    ]
    same = [torch.equal(results[0], r) for r in results[1:]]
    if invariant:
        assert all(same)
    else:
        assert not all(same)  # what the mode is there to remove
    # Every way is the same attention, numerically (GQA heads included): SDPA's prefill.
    reference = _attend_steps(TorchAttentionBackend(), ways[0], qkv, cache_dtype, kv_scales=scales)[
        (0, 39)
    ]
    for r in results:
        torch.testing.assert_close(r, reference, rtol=1e-5, atol=1e-6)


def test_serve_and_bench_take_the_flag():
    from pagedllm.entrypoints.cli.main import build_parser

    parser = build_parser()
    for argv in (
        ["serve", "m", "--batch-invariant"],
        ["bench", "throughput", "--model", "m", "--batch-invariant"],
    ):
        assert EngineArgs.from_cli_args(parser.parse_args(argv)).batch_invariant
    assert not EngineArgs.from_cli_args(parser.parse_args(["serve", "m"])).batch_invariant
