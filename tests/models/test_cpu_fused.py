"""The fused decoder-layer ops (`layers/cpu_fused.py`) against the layers' own modules, every
other native kernel on in both runs: the same tokens and bit for bit the same logprobs, over
prefills, chunked prefills mixed with decodes, prefix-cache hits and decode-only steps (all
layers in one call there, `FusedStack`)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import cpu_fused
from pagedllm.layers.cpu_gemm import panel_kernel
from pagedllm.ops import cpu_ops

pytestmark = pytest.mark.skipif(
    cpu_ops() is None or not cpu_ops().cpu_has_avx2_fma(), reason="no native AVX2 kernels here"
)

PROMPTS = [
    [5, 17, 99, 230, 31, 8, 77],
    [400, 12, 12, 301, 9],
    list(range(40, 130)),  # longer than a chunk: its prefill runs beside the others' decodes
    [5, 17, 99, 230, 31, 8, 77, 64, 3],  # shares a prefix with the first prompt
]


def _model(llm):
    """The engine's LlamaModel (embedding, layers, norm)."""
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model.model


def _run(model_dir, monkeypatch, **kw):
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(
        model=model_dir,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=32,  # chunked prefill: mixed prefill + decode steps
        enable_prefix_caching=True,
        seed=0,
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = _model(llm)
    plans = [layer._fused for layer in model.layers] + [model._fused_stack]
    llm.shutdown()
    results = [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    return results, plans


@pytest.mark.parametrize(
    "arch, dtype, quantization",
    [
        ("llama", "bfloat16", None),
        ("llama", "float32", None),
        ("qwen2", "bfloat16", None),  # biases on q, k, v
        ("qwen3", "bfloat16", None),  # a per-head RMSNorm of q and k before RoPE
        ("qwen3", "float32", "int8"),
        ("llama", "bfloat16", "int8"),
        ("mistral", "float32", "int8"),
    ],
)
def test_fused_layers_change_no_output(arch, dtype, quantization, tiny_model_dirs, monkeypatch):
    from pagedllm.attention.cpu_backend import CpuAttentionBackend

    weights = torch.int8 if quantization == "int8" else getattr(torch, dtype)
    if panel_kernel(weights) is None:  # e.g. fp32 on an AVX-512 CPU: oneDNN's GEMMs
        pytest.skip(f"{weights} weights take no panel kernel on this CPU: no fused layers")
    # Both of the fused path's branches run: whole layers on decode-only steps, the two ops
    # around the backend's attention on the others.
    seen = {"decode-only": 0, "other": 0}
    decode_only = CpuAttentionBackend.decode_only

    def counted(self, metadata, num_tokens):
        d = decode_only(self, metadata, num_tokens)
        seen["other" if d is None else "decode-only"] += 1
        return d

    monkeypatch.setattr(CpuAttentionBackend, "decode_only", counted)
    stacked = {"steps": 0}
    stack_forward = cpu_fused.FusedStack.forward

    def counted_stack(self, *args):
        out = stack_forward(self, *args)
        stacked["steps"] += out is not None
        return out

    monkeypatch.setattr(cpu_fused.FusedStack, "forward", counted_stack)
    kw = dict(dtype=dtype, quantization=quantization)
    fused, plans = _run(tiny_model_dirs[arch], monkeypatch, **kw)
    *layer_plans, stack = plans
    assert layer_plans and all(isinstance(p, cpu_fused.FusedLayer) for p in layer_plans)
    assert isinstance(stack, cpu_fused.FusedStack)
    # Decode-only steps ran the whole stack in one call; the others went layer by layer.
    assert stacked["steps"] > 0 and seen["decode-only"] >= stacked["steps"] and seen["other"] > 0
    import pagedllm.models.llama as llama

    monkeypatch.setattr(llama, "layer_plan", lambda layer: None)
    plain, plans = _run(tiny_model_dirs[arch], monkeypatch, **kw)
    assert plans and not any(plans)
    assert fused == plain


def test_layers_that_do_not_qualify_keep_their_modules(tiny_model_dirs, monkeypatch):
    # Batch-invariant mode's norms and products are not the fused ops' kernels.
    _, plans = _run(tiny_model_dirs["qwen3"], monkeypatch, dtype="bfloat16", batch_invariant=True)
    assert plans and not any(plans)
