"""kv_cache_dtype="fp8" / "fp8_e4m3" / "fp8_e5m2" (vLLM's) end to end, with scale 1.0 and
with calculate_kv_scales' calibrated scales: the config, the cache's size and dtype, greedy
output against transformers with its K/V round-tripped through fp8, the bytes the cache holds,
the engine features that must not change the output, the native CPU kernels against
TORCH_SDPA, speculative decoding's draft cache and a KV connector moving fp8 blocks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.layer import get_attention_layers
from pagedllm.config import kv_cache_dtype_str_to_dtype
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.ops import cpu_ops
from pagedllm.worker.worker import Worker

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MAX_NEW = 12


def _fp8(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What an fp8 cache with `scale` holds for `x` (the contract, written out here
    independently): x times the fp32 reciprocal of the scale, saturated, rounded."""
    bound = torch.finfo(cache_dtype).max
    inv = float(np.float32(1.0) / np.float32(scale))
    return (x.float() * inv).clamp(-bound, bound).to(cache_dtype)


def _read(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as a read of it from such a cache sees it, in x's dtype."""
    return (_fp8(x, cache_dtype, scale).float() * np.float32(scale)).to(x.dtype)


def _scales(llm: LLM) -> list[tuple[float, float]]:
    return [
        (layer.kv_scales.k, layer.kv_scales.v) for layer in get_attention_layers(_runner(llm).model)
    ]


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _shared_prefix_prompts() -> list[list[int]]:
    """Six prompts after one 48-token prefix (prefix-cache hits), up to 88 tokens."""
    shared = _prompts([48], seed=1)[0]
    return [shared + tail for tail in _prompts([20, 35, 9, 40, 26, 17], seed=2)]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW, logprobs: int = 2):
    """Greedy outputs of `prompts`, with `logprobs` top logprobs (None: none)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _results(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(tokens, [{token: logprob}] per step) of each output."""
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or ()],
        )
        for o in outputs
    ]


def _generate(llm: LLM, prompts: list[list[int]], **kwargs):
    return _results(_run(llm, prompts, **kwargs))


def _max_logprob_difference(a, b) -> float:
    """Largest difference of the logprobs two runs both report (their tokens are equal)."""
    return max(
        abs(x[t] - y[t])
        for (_, steps_a), (_, steps_b) in zip(a, b)
        for x, y in zip(steps_a, steps_b)
        for t in x.keys() & y.keys()
    )


def _tokens(results) -> list[list[int]]:
    return [tokens for tokens, _ in results]


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _runner(llm: LLM):
    return _core(llm).executor.worker.model_runner


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(
        model=model_dir, dtype="float32", **{"seed": 0, "kv_cache_memory": 8 << 20, **kwargs}
    )


# ---- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, model_dtype, expected",
    [
        ("auto", torch.float32, torch.float32),
        ("auto", torch.bfloat16, torch.bfloat16),
        ("float32", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),  # the model dtype's other name
        ("fp8", torch.bfloat16, torch.float8_e4m3fn),
        ("fp8_e4m3", torch.float32, torch.float8_e4m3fn),
        ("fp8_e5m2", torch.bfloat16, torch.float8_e5m2),
    ],
)
def test_kv_cache_dtype_resolves(value, model_dtype, expected):
    assert kv_cache_dtype_str_to_dtype(value, model_dtype) == expected


@pytest.mark.parametrize("value", ["fp8_inc", "fp8_ds_mla", "float16", "int8", "FP8"])
def test_other_kv_cache_dtypes_are_refused_by_name(value):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{value}' is not supported") as e:
        kv_cache_dtype_str_to_dtype(value, torch.bfloat16)
    assert all(repr(ok) in str(e.value) for ok in ("auto", "bfloat16", *FP8))


def test_the_config_keeps_vllms_string_and_resolves_the_dtype(tiny_llama_dir):
    config = EngineArgs(
        model=tiny_llama_dir, device="cpu", dtype="bfloat16", kv_cache_dtype="fp8_e5m2"
    ).create_engine_config()
    assert config.cache_config.cache_dtype == "fp8_e5m2"  # vLLM's CacheConfig.cache_dtype
    assert config.kv_cache_torch_dtype == torch.float8_e5m2
    assert config.model_config.dtype == torch.bfloat16  # the model runs as before
    auto = EngineArgs(model=tiny_llama_dir, device="cpu", dtype="float32").create_engine_config()
    assert auto.cache_config.cache_dtype == "auto" and auto.kv_cache_torch_dtype == torch.float32


# ---- the cache ---------------------------------------------------------------------------


def _worker(model_dir: str, **kwargs) -> Worker:
    config = EngineArgs(
        model=model_dir, device="cpu", kv_cache_memory_bytes=8 << 20, **kwargs
    ).create_engine_config()
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    return worker


def test_fp8_caches_are_float8_and_hold_more_blocks(tiny_llama_dir):
    """The same kv_cache_memory_bytes holds 4x the blocks of an fp32 cache, 2x of bf16; the
    idle engine's prefault walks the fp8 cache's pages as any other's."""

    def num_blocks(dtype: str, kv_cache_dtype: str = "auto") -> int:
        worker = _worker(tiny_llama_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        return worker.determine_num_kv_blocks()

    fp8_blocks = num_blocks("float32", "fp8")
    assert fp8_blocks == 4 * num_blocks("float32") == 2 * num_blocks("bfloat16")
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        worker = _worker(tiny_llama_dir, dtype="bfloat16", kv_cache_dtype=kv)
        count = worker.determine_num_kv_blocks()
        assert count == fp8_blocks
        worker.initialize_kv_cache(count)
        runner = worker.model_runner
        assert [c.dtype for c in runner.kv_caches] == [FP8[kv]] * len(runner.kv_caches)
        assert runner.kv_caches[0].shape[1] == count
        prefault = runner.kv_prefaulter
        while prefault.step():
            pass
        assert prefault.populated_blocks == count


# ---- output ------------------------------------------------------------------------------


def _hf_fp8_greedy(model_dir: str, cache_dtype: torch.dtype, prompts, max_new: int, scales=None):
    """transformers (fp32) with every layer's K/V round-tripped through the fp8 cache rule
    before its attention reads them (with `scales[layer]`, (k, v), where given): (tokens,
    logprob of each) per prompt."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_sdpa(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales[module.layer_idx] if scales else (1.0, 1.0)
        key, value = _read(key, cache_dtype, k_scale), _read(value, cache_dtype, v_scale)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    name = f"pagedllm_test_{cache_dtype}_{bool(scales)}".replace(".", "_")
    AttentionInterface.register(name, fp8_kv_sdpa)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=name
    ).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids, steps = list(prompt), []
            for _ in range(max_new):  # the whole sequence each step: no cache of its own
                logprobs = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                token = int(logprobs.argmax())
                steps.append({token: float(logprobs[token])})
                ids.append(token)
            results.append((ids[len(prompt) :], steps))
    return results


@pytest.mark.parametrize("calculate_kv_scales", [False, True], ids=["unit", "calculated"])
@pytest.mark.parametrize("attention_backend", ["TORCH_SDPA", None])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_greedy_matches_transformers_with_fp8_kv(
    model_dirs, kv_cache_dtype, attention_backend, calculate_kv_scales
):
    """The oracle: transformers whose attention reads fp8-rounded K/V (with the engine's
    calibrated scales, calculate_kv_scales). The same tokens and logprobs, with TORCH_SDPA
    and with the CPU default (the native kernels, where built)."""
    model_dir = model_dirs["qwen3"]  # q/k norms: K is normed, then rotated, then stored
    prompts = _prompts([5, 17, 33, 64])
    llm = _llm(
        model_dir,
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend,
        calculate_kv_scales=calculate_kv_scales,
    )
    got = _generate(llm, prompts, logprobs=0)
    scales = _scales(llm) if calculate_kv_scales else None
    llm.shutdown()
    if calculate_kv_scales:
        assert all(k != 1.0 and v != 1.0 for k, v in scales)
    expected = _hf_fp8_greedy(model_dir, FP8[kv_cache_dtype], prompts, MAX_NEW, scales)
    assert _tokens(got) == _tokens(expected)
    assert _max_logprob_difference(got, expected) < 1e-4


@pytest.mark.parametrize("calculate_kv_scales", [False, True], ids=["unit", "calculated"])
@pytest.mark.parametrize("attention_backend", ["TORCH_SDPA", None])
def test_the_cache_holds_the_quantized_kv_the_model_computed(
    tiny_llama_dir, attention_backend, calculate_kv_scales
):
    """Every layer's cache slots hold `clamp(k * inv).to(fp8)` of the K/V its attention was
    given, inv the reciprocal of the layer's scale (the K/V write of TORCH_SDPA, or the
    native kernel's)."""
    llm = _llm(
        tiny_llama_dir,
        kv_cache_dtype="fp8",
        attention_backend=attention_backend,
        calculate_kv_scales=calculate_kv_scales,
    )
    seen = []
    layers = get_attention_layers(_runner(llm).model)

    def record(layer, args):
        _, k, v, meta = args
        seen.append((layer, k.clone(), v.clone(), meta.slot_mapping.clone()))

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    _generate(llm, _prompts([40]), max_tokens=1)  # the prefill only
    for hook in hooks:
        hook.remove()
    assert {id(layer) for layer, *_ in seen} == {id(layer) for layer in layers}
    for layer, k, v, slots in seen:
        n, row = slots.shape[0], k.shape[-1]
        cache = layer.kv_cache.view(2, -1, row)  # [2, slots, Hkv * D]
        assert cache.dtype == torch.float8_e4m3fn
        for half, (x, scale) in enumerate(((k, layer.kv_scales.k), (v, layer.kv_scales.v))):
            assert (scale != 1.0) == calculate_kv_scales
            stored = cache[half, slots].view(torch.uint8)
            want = _fp8(x[:n], torch.float8_e4m3fn, scale).view(torch.uint8)
            assert torch.equal(stored, want)
            assert stored.any()
    llm.shutdown()


@pytest.mark.parametrize("calculate_kv_scales", [False, True], ids=["unit", "calculated"])
def test_caching_chunking_and_preemption_keep_fp8_output(tiny_llama_dir, calculate_kv_scales):
    """Every read of K/V sees the stored fp8 values (a prefill's own rows included): prefix
    caching, chunked prefill and preemption (recompute) change no token and no logprob, with
    scale 1 and with calibrated scales (the calibration is one forward whatever the token
    budget, so both engines compute the same scales). The same workload over an fp32 cache
    gives other logprobs: the cache really is fp8."""
    prompts = _shared_prefix_prompts()
    common = dict(
        kv_cache_dtype="fp8",
        attention_backend="TORCH_SDPA",
        max_model_len=128,
        calculate_kv_scales=calculate_kv_scales,
    )
    plain = _llm(
        tiny_llama_dir, enable_prefix_caching=False, enable_chunked_prefill=False, **common
    )
    reference = _generate(plain, prompts, max_tokens=24)
    assert _core(plain).scheduler.num_preemptions_total == 0
    plain.shutdown()

    busy = dict(
        enable_prefix_caching=True,
        max_num_batched_tokens=32,  # prompts over several steps
        num_gpu_blocks_override=12,  # 6 requests of up to 112 tokens: preemptions
        max_num_seqs=4,
    )
    llm = _llm(tiny_llama_dir, **busy, **common)
    outputs = _run(llm, prompts, max_tokens=24)
    assert _core(llm).scheduler.num_preemptions_total > 0
    assert any(o.num_cached_tokens >= 48 for o in outputs)  # prefix-cache hits
    llm.shutdown()
    got = _results(outputs)
    assert _tokens(got) == _tokens(reference)
    assert _max_logprob_difference(got, reference) < 1e-4

    auto = {**common, "kv_cache_dtype": "auto", "calculate_kv_scales": False}
    full = _llm(tiny_llama_dir, **busy, **auto)
    fp32_cache = _generate(full, prompts[:2], max_tokens=24)
    full.shutdown()
    assert _max_logprob_difference(fp32_cache, reference[:2]) > 1e-3


@pytest.mark.skipif(cpu_ops() is None, reason="native CPU ops not built here")
@pytest.mark.parametrize(
    "kv_cache_dtype, calculate_kv_scales",
    [("fp8", False), ("fp8_e5m2", False), ("fp8", True)],
)
def test_native_cpu_backend_matches_torch_sdpa(tiny_llama_dir, kv_cache_dtype, calculate_kv_scales):
    """The CPU default (native decode and prefill kernels, whole fused layers on decode-only
    steps, which read the layers' scales set after the first forward built them) over an fp8
    cache against TORCH_SDPA over one, on a mixed chunked workload with prefix-cache hits and
    whole short prompts: the same tokens, logprobs within 1e-4 (fp32 model)."""
    prompts = _shared_prefix_prompts() + _prompts([5, 17])
    results = {}
    for backend in ("TORCH_SDPA", None):
        llm = _llm(
            tiny_llama_dir,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=backend,
            max_num_batched_tokens=32,
            calculate_kv_scales=calculate_kv_scales,
        )
        results[backend] = _generate(llm, prompts, max_tokens=16)
        assert type(_runner(llm).attn_backend).__name__ == (
            "TorchAttentionBackend" if backend else "CpuAttentionBackend"
        )
        llm.shutdown()
    assert _tokens(results[None]) == _tokens(results["TORCH_SDPA"])
    assert _max_logprob_difference(results[None], results["TORCH_SDPA"]) < 1e-4


def test_trained_model_keeps_its_greedy_tokens(copy_model_dir):
    """A model that copies repeated text (its choices decided, not rounding noise) keeps most
    greedy tokens with an e4m3 cache: the tokens before each request's first disagreement
    with the fp32 cache, over all requests (measured: 90%; a cache read wrongly: near 0)."""
    from pagedllm.testing.copy_model import copy_prompts
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    prompts = copy_prompts(get_tokenizer(copy_model_dir), 16, 40, seed=3)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = _llm(copy_model_dir, kv_cache_dtype=kv)
        outs[kv] = _tokens(_generate(llm, prompts, max_tokens=24, logprobs=None))
        llm.shutdown()
    agree = sum(
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(outs["auto"], outs["fp8"])
    )
    assert agree / sum(map(len, outs["auto"])) >= 0.8


def test_draft_model_cache_is_fp8_too(tiny_llama_dir):
    """Speculative decoding's drafter keeps its KV in the target's cache dtype (one backend
    reads both; its blocks are counted in the same budget): greedy output unchanged."""
    prompts = _prompts([9, 30])
    plain = _llm(tiny_llama_dir, kv_cache_dtype="fp8")
    reference = _tokens(_generate(plain, prompts, logprobs=None))
    plain_blocks = _core(plain).num_blocks
    plain.shutdown()
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_llama_dir}
    llm = _llm(tiny_llama_dir, kv_cache_dtype="fp8", speculative_config=spec)
    drafter = _runner(llm).drafter
    assert drafter.kv_caches and {c.dtype for c in drafter.kv_caches} == {torch.float8_e4m3fn}
    assert _core(llm).num_blocks == plain_blocks // 2  # target and draft: twice the bytes
    assert _tokens(_generate(llm, prompts, logprobs=None)) == reference
    llm.shutdown()


# ---- KV connectors -----------------------------------------------------------------------

BUSY = dict(
    kv_cache_dtype="fp8",
    max_model_len=128,
    num_gpu_blocks_override=12,  # preemptions: evicted blocks come back through the connector
    max_num_batched_tokens=32,
    max_num_seqs=4,
)


def _offloading(**extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def fp8_reference(tiny_llama_dir):
    """The busy fp8 workload without a connector."""
    llm = _llm(tiny_llama_dir, **BUSY)
    results = _generate(llm, _shared_prefix_prompts(), max_tokens=24)
    llm.shutdown()
    return results


def test_offloading_cpu_tier_moves_fp8_blocks_exactly(tiny_llama_dir, fp8_reference):
    """Blocks offloaded to CPU memory and loaded back (the only cache hits without prefix
    caching) give the output the engine computes without the connector."""
    prompts = _shared_prefix_prompts()
    llm = _llm(
        tiny_llama_dir,
        **BUSY,
        enable_prefix_caching=False,
        kv_transfer_config=_offloading(num_cpu_blocks=64),
    )
    first = _results(_run(llm, prompts, max_tokens=24))
    second = _run(llm, prompts, max_tokens=24)
    llm.shutdown()
    assert all(o.num_cached_tokens >= 48 for o in second)  # loaded from the CPU tier
    for got in (first, _results(second)):
        assert _tokens(got) == _tokens(fp8_reference)
        assert _max_logprob_difference(got, fp8_reference) < 1e-4


def test_offloading_disk_tier_stores_fp8_blocks(tiny_llama_dir, fp8_reference, tmp_path):
    """Block files hold an fp8 block's bytes (a quarter of an fp32 one's) and a restarted
    engine reads them back into the output of one computing everything. An fp32 cache of
    the same model keeps its blocks in another directory (the config hash names the cache's
    dtype), so neither ever reads the other's."""
    import os

    prompts = _shared_prefix_prompts()
    config = _offloading(num_cpu_blocks=4, disk_path=str(tmp_path))
    first = _llm(tiny_llama_dir, **BUSY, kv_transfer_config=config)
    _run(first, prompts, max_tokens=24)
    first.shutdown()
    (fingerprint,) = os.listdir(tmp_path / "pagedllm-kv")
    files = [f for f in os.listdir(tmp_path / "pagedllm-kv" / fingerprint) if f.endswith(".kv")]
    block_bytes = 2 * 2 * 16 * 2 * 16  # layers * K/V * tokens * kv heads * head dim, 1 byte
    assert files
    for name in files:
        assert os.path.getsize(tmp_path / "pagedllm-kv" / fingerprint / name) == block_bytes

    restarted = _llm(tiny_llama_dir, **BUSY, kv_transfer_config=config)
    outputs = _run(restarted, prompts, max_tokens=24)
    restarted.shutdown()
    assert outputs[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16  # from disk
    assert _tokens(_results(outputs)) == _tokens(fp8_reference)
    assert _max_logprob_difference(_results(outputs), fp8_reference) < 1e-4

    fp32 = _llm(tiny_llama_dir, **{**BUSY, "kv_cache_dtype": "auto"}, kv_transfer_config=config)
    assert _run(fp32, prompts[:1], max_tokens=1)[0].num_cached_tokens == 0
    fp32.shutdown()
    assert len(os.listdir(tmp_path / "pagedllm-kv")) == 2


# ---- calculate_kv_scales -----------------------------------------------------------------


def test_calculated_scales_are_the_calibration_prompts_maxima(tiny_llama_dir):
    """Each layer's scales are max |K| / 200 and max |V| / 100 (vLLM's constants) over the
    calibration prompt: min(1024, max_model_len) token ids drawn by a generator seeded with
    the model's seed. Measured here independently: the same prompt through an engine
    without calibration, its attention layers' inputs recorded."""
    max_model_len, seed = 96, 5
    llm = _llm(
        tiny_llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True,
        max_model_len=max_model_len, seed=seed,
    )  # fmt: skip
    scales = _scales(llm)
    vocab = _runner(llm).config.model_config.hf_config.vocab_size
    llm.shutdown()
    ids = torch.randint(vocab, (max_model_len,), generator=torch.Generator().manual_seed(seed))

    plain = _llm(tiny_llama_dir, kv_cache_dtype="fp8", max_model_len=max_model_len + 1, seed=seed)
    layers = get_attention_layers(_runner(plain).model)
    maxima = {id(layer): [] for layer in layers}

    def record(layer, args):
        _, k, v, _ = args
        maxima[id(layer)].append((float(k.abs().max()), float(v.abs().max())))

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    _run(plain, [ids.tolist()], max_tokens=1, logprobs=None)  # one prefill step
    for hook in hooks:
        hook.remove()
    plain.shutdown()
    expected = []
    for layer in layers:
        ((k_max, v_max),) = maxima[id(layer)]
        expected.append((float(np.float32(k_max / 200)), float(np.float32(v_max / 100))))
    assert scales == expected
    assert len(set(scales)) > 1  # per layer


def test_calculated_scales_are_the_same_in_every_engine_of_a_seed(tiny_llama_dir):
    """Two engines (other token budgets, other backends) compute the same scales; another seed
    draws another calibration prompt, and other scales."""
    common = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    runs = [
        dict(seed=0),
        dict(seed=0, max_num_batched_tokens=64, attention_backend="TORCH_SDPA"),
        dict(seed=1),
    ]
    got = []
    for kwargs in runs:
        llm = _llm(tiny_llama_dir, **common, **kwargs)
        got.append(_scales(llm))
        llm.shutdown()
    assert got[0] == got[1] != got[2]


def test_calculate_kv_scales_needs_an_fp8_cache_and_no_draft_cache(tiny_llama_dir):
    with pytest.raises(ValueError, match="calculate_kv_scales=True.*kv_cache_dtype='auto'"):
        EngineArgs(
            model=tiny_llama_dir, device="cpu", calculate_kv_scales=True
        ).create_engine_config()
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_llama_dir}
    with pytest.raises(ValueError, match="calculate_kv_scales=True.*'draft_model'"):
        EngineArgs(
            model=tiny_llama_dir, device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True,
            speculative_config=spec,
        ).create_engine_config()  # fmt: skip
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    config = EngineArgs(
        model=tiny_llama_dir, device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True,
        speculative_config=ngram,
    ).create_engine_config()  # fmt: skip
    assert config.cache_config.calculate_kv_scales


def test_the_cli_takes_calculate_kv_scales(tiny_llama_dir):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert ns.calculate_kv_scales is True and ns.kv_cache_dtype == "fp8"
    assert parser.parse_args([]).calculate_kv_scales is False


def test_scaled_blocks_are_kept_apart(tiny_llama_dir):
    """Blocks stored with calibrated scales mean other values than unit-scale ones: the disk
    tier's directory (the config fingerprint) and the peer-to-peer layout name them."""
    from pagedllm.distributed.kv_transfer.kv_blocks import PagedKVBlocks, kv_cache_fingerprint

    def fingerprint(**kwargs) -> str:
        args = EngineArgs(model=tiny_llama_dir, device="cpu", kv_cache_dtype="fp8", **kwargs)
        return kv_cache_fingerprint(args.create_engine_config())

    unit, scaled = fingerprint(), fingerprint(calculate_kv_scales=True)
    assert unit != scaled == fingerprint(calculate_kv_scales=True)
    assert scaled != fingerprint(calculate_kv_scales=True, seed=3)
    caches = {"a": torch.zeros(2, 4, 16, 2, 8, dtype=torch.float8_e4m3fn)}
    plain = PagedKVBlocks(caches, 1).describe()
    assert PagedKVBlocks(caches, 1, {"a": (1.0, 1.0)}).describe() == plain
    described = PagedKVBlocks(caches, 1, {"a": (0.25, 0.5)}).describe()
    assert described == {**plain, "kv_scales": [[0.25, 0.5]]}
