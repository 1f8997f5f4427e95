"""TritonAttentionBackend against the torch backend (the reference) on the same paged
batches: same outputs, same cache contents (fp8 caches too), padding rows ignored."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.fp8_kv import UNIT_SCALES
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.ops.triton import triton_usable
from tests.attention.test_torch_backend import SCALED, SCENARIOS, Batch, check, fp8_batch
from tests.ops.triton.devices import TRITON_DEVICES


def _backend():
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _forward(
    backend, batch: Batch, query=None, key=None, value=None, kv_scales=UNIT_SCALES
) -> torch.Tensor:
    meta = backend.build_metadata(batch.common)
    return backend.forward(
        batch.query if query is None else query,
        batch.key if key is None else key,
        batch.value if value is None else value,
        batch.kv_cache,
        meta,
        batch.query.shape[-1] ** -0.5,
        kv_scales,
    )


def _batch(scenario: str, device: str, dtype=torch.float32, **kwargs) -> Batch:
    return Batch(
        SCENARIOS[scenario],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        dtype=dtype,
        device=device,
        seed=11,
        **kwargs,
    )


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("scenario", ["mixed", "chunked_prefill"])
def test_same_output_and_cache_as_torch_backend(device, scenario):
    triton_batch, torch_batch = _batch(scenario, device), _batch(scenario, device)
    out = _forward(_backend(), triton_batch)
    ref = _forward(TorchAttentionBackend(), torch_batch)
    check(triton_batch, out)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(triton_batch.kv_cache, torch_batch.kv_cache)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["mixed", "chunked_prefill"])
@pytest.mark.parametrize("kv_scales", [UNIT_SCALES, SCALED], ids=["unit", "scaled"])
def test_fp8_cache_as_the_torch_backend(device, scenario, dtype, cache_dtype, kv_scales):
    """kv_cache_dtype fp8: every row attends to K/V as the cache stores them with its scales
    (the step's own rows included), and the cache ends with the bytes the torch backend
    writes."""
    spec = SCENARIOS[scenario]
    shape = dict(block_size=16, num_heads=4, num_kv_heads=2, head_size=16, seed=11)
    batches = [fp8_batch(spec, cache_dtype, dtype, device, kv_scales, **shape) for _ in range(2)]
    out = _forward(_backend(), batches[0], kv_scales=kv_scales)
    ref = _forward(TorchAttentionBackend(), batches[1], kv_scales=kv_scales)
    assert out.dtype == dtype and batches[0].kv_cache.dtype == cache_dtype
    check(batches[0], out)
    torch.testing.assert_close(out, ref, atol=2e-5 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    raw = [b.kv_cache.view(torch.uint8) for b in batches]
    assert torch.equal(raw[0], raw[1])


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_padding_rows_are_ignored(device):
    """Rows past num_actual_tokens (NaN) reach neither the cache nor the outputs; their own
    outputs are zero, as the torch backend's."""
    batch = _batch("decode", device, pad_rows=3)
    out = _forward(_backend(), batch)
    check(batch, out)
    assert not batch.kv_cache.isnan().any()
    assert torch.equal(out[batch.num_tokens :].cpu(), torch.zeros(3, 4, 16))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_noncontiguous_qkv_views(device):
    """q/k/v split from one fused projection output, as the models call the layer."""
    batch = _batch("spec_decode", device)
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], 1)
    q, k, v = fused.split([4 * 16, 2 * 16, 2 * 16], dim=1)
    out = _forward(_backend(), batch, q.view(-1, 4, 16), k.view(-1, 2, 16), v.view(-1, 2, 16))
    check(batch, out)


def test_same_cache_layout_as_torch_backend():
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    shape = TritonAttentionBackend.get_kv_cache_shape(10, 16, 4, 64)
    assert shape == TorchAttentionBackend.get_kv_cache_shape(10, 16, 4, 64)


@pytest.mark.parametrize(
    "kv_cache_dtype, calculate_kv_scales",
    [("auto", False), ("fp8", False), ("fp8_e5m2", False), ("fp8", True)],
)
def test_engine_greedy_tokens_match_torch_backend(
    tiny_llama_dir, monkeypatch, kv_cache_dtype, calculate_kv_scales
):
    """The whole engine on TRITON_ATTN (interpreted on the CPU) emits the torch backend's
    greedy tokens and logprobs, through chunked prefill, a prefix-cache hit and mixed prefill
    + decode steps; with an fp8 cache too (both then attend over its fp8 rows), with
    calibrated scales too."""
    from pagedllm import LLM, SamplingParams

    if not triton_usable("cpu"):
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET)")
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    shared = list(range(40, 56))  # one full block shared by the last two prompts
    prompts = [[7, 8, 9, 10, 11], shared + [3, 4, 5], shared + [60, 61, 62, 63, 64, 65]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    outputs = {}
    for backend in ("TORCH_SDPA", "TRITON_ATTN"):
        llm = LLM(
            model=tiny_llama_dir,
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            attention_backend=backend,
            num_gpu_blocks_override=16,
            max_model_len=128,
            max_num_batched_tokens=16,
            max_num_seqs=4,
        )
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        assert runner.attn_backend.name == backend
        width = 4 if kv_cache_dtype == "auto" else 1
        assert all(c.dtype.itemsize == width for c in runner.kv_caches)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[backend] = [
            (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for c in (o.outputs[0] for o in outs)
        ]
    for (ids, lps), (ref_ids, ref_lps) in zip(outputs["TRITON_ATTN"], outputs["TORCH_SDPA"]):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=1e-4)
