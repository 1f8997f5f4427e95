"""CPU GEMMs on packed weights (oneDNN-prepacked or pagedllm's panels) compute what F.linear
computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_gemm import can_pack, from_panels, to_panels
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.ops import cpu_ops

needs_packing = pytest.mark.skipif(
    not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)), reason="no oneDNN bf16 packing here"
)


@needs_packing
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(tokens):
    torch.manual_seed(0)
    with torch.device("cpu"):
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    layer.process_weights_after_loading()
    assert layer.weight.numel() == 0  # the plain copy's storage is freed
    x = torch.randn(tokens, 64, dtype=torch.bfloat16)
    expected = F.linear(x, weight, bias).float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")
def test_fp32_is_packed(monkeypatch):
    """fp32 weights go to the fp32 panels on AVX2 CPUs without AVX-512, else to oneDNN
    prepacked; either product differs from F.linear's (MKL) only in the order of the fp32
    sums. PAGEDLLM_CPU_PACK_WEIGHTS=0 keeps the plain weight, bit-exact with F.linear."""
    ops = cpu_ops()
    panels = ops is not None and ops.cpu_has_avx2_fma() and not torch.cpu._is_avx512_supported()
    for m in (1, 5, 64):
        with torch.device("cpu"):
            layer = RowParallelLinear(576, 200, params_dtype=torch.float32)
        layer.weight.data.normal_()
        weight = layer.weight.data.clone()
        layer.process_weights_after_loading()
        assert layer.weight.numel() == 0
        if panels:
            assert layer.weight_panels.dtype == torch.float32
            assert getattr(layer, "weight_packed", None) is None
        else:
            assert layer.weight_packed is not None
            assert getattr(layer, "weight_panels", None) is None
        x = torch.randn(m, 576)
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("PAGEDLLM_CPU_PACK_WEIGHTS", "0")
    with torch.device("cpu"):
        layer = RowParallelLinear(32, 16, params_dtype=torch.float32)
    layer.weight.data.normal_()
    weight = layer.weight.data.clone()
    layer.process_weights_after_loading()
    assert getattr(layer, "weight_packed", None) is None and torch.equal(layer.weight, weight)
    x = torch.randn(3, 32)
    assert torch.equal(layer(x), F.linear(x, weight))


def test_tied_lm_head_keeps_its_table(monkeypatch):
    """A tied LM head is the embedding table too: it gets a packed copy for the logits and
    keeps its rows for the lookups."""
    from pagedllm.layers.logits_processor import LogitsProcessor
    from pagedllm.layers.vocab_embedding import VocabParallelEmbedding

    with torch.device("cpu"):
        table = VocabParallelEmbedding(100, 64, params_dtype=torch.float32)
    table.weight.data.normal_()
    weight = table.weight.data.clone()
    table.process_weights_after_loading()  # not a head: nothing packed
    assert getattr(table, "weight_packed", None) is None
    table.tied_lm_head = True
    table.process_weights_after_loading()
    assert torch.equal(table.weight, weight)
    ids = torch.tensor([0, 5, 99])
    assert torch.equal(table(ids), weight[ids])
    h = torch.randn(4, 64)
    logits = LogitsProcessor(100)(table, h)
    torch.testing.assert_close(logits, h @ weight.T, rtol=1e-5, atol=1e-4)
    if torch.backends.mkldnn.is_available():
        packed = getattr(table, "weight_packed", None)
        assert packed is not None or table.weight_panels is not None


def test_bf16_stays_plain_without_onednn_bf16(monkeypatch):
    """oneDNN's bf16 reorder needs AVX-512 or AVX-NE-CONVERT: on an AVX2-only CPU the
    weight must stay plain for F.linear, not fail at load."""
    from pagedllm.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm, "can_use_panels", lambda weight: False)
    with torch.device("cpu"):
        layer = RowParallelLinear(32, 16, params_dtype=torch.bfloat16)
    layer.weight.data.normal_()
    weight = layer.weight.data.clone()
    layer.process_weights_after_loading()
    assert getattr(layer, "weight_packed", None) is None
    assert torch.equal(layer.weight.data, weight)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight))


def test_fp16_weights_stay_plain():
    """No CPU kernel takes fp16 weights: an explicit `dtype="float16"` model loads (it used to
    fail on an AVX2 CPU, sent to the bf16 panels) and multiplies with F.linear."""
    with torch.device("cpu"):
        layer = RowParallelLinear(64, 32, params_dtype=torch.float16)
    layer.weight.data.normal_()
    weight = layer.weight.data.clone()
    layer.process_weights_after_loading()
    assert layer.cpu_gemm is None and torch.equal(layer.weight.data, weight)
    x = torch.randn(3, 64, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, weight))


SHAPES = [(64, 2), (100, 6), (130, 768)]


@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.bfloat16, s) for s in SHAPES] + [(torch.int8, s) for s in SHAPES + [(65, 7)]],
)
def test_panels_round_trip(dtype, shape):
    """bf16: k-pairs; int8: k-quads, K padded with zero columns to whole quads."""
    n, k = shape
    w = (torch.randn(n, k) * 50).to(dtype)
    group = 2 if dtype == torch.bfloat16 else 4
    panels = to_panels(w)
    assert panels.shape == (-(-n // 64), -(-k // group), 64, group)
    assert torch.equal(from_panels(panels, n, k), w)
    full = from_panels(panels, panels.shape[0] * 64)
    assert not full[n:].any() and not full[:, k:].any()  # zero padding


@needs_packing
def test_bf16_engine_same_tokens_with_and_without_packing(tiny_llama_dir, monkeypatch):
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello world", "The cat sat on"]
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_CPU_PACK_WEIGHTS", flag)
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16")
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        packed = [
            m
            for m in runner.model.modules()
            if getattr(m, "weight_packed", None) is not None
            or getattr(m, "weight_panels", None) is not None
        ]
        assert bool(packed) == (flag == "1")
        results.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
    assert results[0] == results[1]
