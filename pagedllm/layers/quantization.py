"""int8 quantization (`quantization="int8"`, `--quantization int8`): int8 weights with a
scale per output channel, activations quantized per token on the fly to 16 bits (W8A16,
dynamic): the weights' bytes are what a decode step streams, and 16-bit activations keep
their rounding far below the weights' (8-bit ones, W8A8 as vLLM's CPU int8 path, lost ~8% of
a real chat model's greedy tokens against bf16; 16-bit ones ~4%: BENCHMARKS.md).

A transform applied to a built model before its checkpoint is loaded: every linear layer and
an untied LM head get an int8 weight and a float32 scale per output channel,
`w ~= scale[n] * q[n, k]`, `scale[n] = max_k |w[n, k]| / 127` (symmetric, round to nearest).
Quantization happens in the weight loaders, one checkpoint tensor at a time: the loader
quantizes the whole checkpoint tensor row by row, then the layer's own loader places this
rank's slice of q and of the scales exactly where it would have placed the weight (a
tensor-parallel shard along the outputs takes its rows' scales; one along the inputs shares
the whole rows' scales, which factor out of its partial sums). The bf16 weight is never held
whole: the layers' plain weights are replaced before loading, while still unwritten.

At run time each row of the input is quantized to int16 over its own largest magnitude
(`quantize_activations`) and multiplied in exact integer arithmetic (`int8_linear`, the
reference; the native kernel, `pagedllm/ops/csrc/gemm_int8.h`, computes the same numbers on
AMX tiles, with AVX512-VNNI, or with AVX2 on CPUs without it). A row's result depends on that
row alone. A tied LM head keeps its table unquantized (the embedding reads it as rows) and,
where the int8 kernel runs, multiplies the logits with an int8 copy of it
(`VocabParallelEmbedding`).
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8",)


def check_quantization(method: str | None) -> str | None:
    """The method, validated (None = unquantized)."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={method!r} is not supported; choose one of {list(QUANTIZATION_METHODS)}"
        )
    return method


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8, scale [N] float32) with w ~= scale[:, None] * q."""
    # |w| and its row maxima are exact in w's own dtype; the division promotes to float32,
    # so no float32 copy of w is made first (start-up: ~1 s less CPU for a 135M model).
    scale = weight.abs().amax(dim=1).float().clamp_min(1e-12) / 127.0
    q = torch.div(weight, scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (xq [M, K] int16, scale [M] float32) with x ~= scale[:, None] * xq: per row,
    symmetric over its largest magnitude (32767 levels a side), round half to even, in float32
    (the native kernel's arithmetic, step for step)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    levels = torch.full_like(amax, 32767.0)  # tensor / tensor: an IEEE division (a Python
    inv = levels / amax  # scalar on either side may become a multiply by a reciprocal)
    xq = torch.round(xf * inv[:, None]).clamp_(-32767, 32767)
    return xq.to(torch.int16), amax / levels


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The int8 layer: x [M, K] (any float dtype), q [N, K] int8, w_scale [N] -> [M, N] in
    `out_dtype`, y = float(sum_k xq q) * x_scale * w_scale + bias, the sums exact."""
    xq, x_scale = quantize_activations(x)
    if x.device.type == "cpu":
        # int8 x int8 -> int32 (`_int_mm`) on the bytes of u = xq + 32768, each shifted by
        # -128 into int8 (what the native kernel multiplies, as uint8): with u = 256 hi + lo,
        # sum xq q = 256 sum (hi - 128) q + sum (lo - 128) q + 128 colsum. Each int32 sum is
        # exact for K <= 65536; the combination is int64.
        u = xq.to(torch.int32) + 32768
        hi = ((u >> 8) - 128).to(torch.int8)
        lo = ((u & 255) - 128).to(torch.int8)
        colsum = q.sum(dim=1, dtype=torch.int64)
        qt = q.T
        dot = 256 * torch._int_mm(hi, qt).long() + torch._int_mm(lo, qt).long() + 128 * colsum
    else:  # `_int_mm` has shape limits on CUDA; float64 sums are exact too (|sum| < 2^53)
        dot = xq.double() @ q.double().T
    y = dot.float() * x_scale[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _int8_layer_(module: nn.Module, load_scale) -> None:
    """Give `module` an int8 `weight` and a float32 `weight_scale` buffer, both filled by a
    loader that quantizes each checkpoint tensor, then defers to the module's own loader;
    `load_scale(scale_buffer, scale, shard_id)` places the scales of one tensor."""
    old = module.weight
    loader = old.weight_loader
    module.activation_dtype = old.dtype  # the model dtype, which x keeps
    weight = nn.Parameter(torch.empty(old.shape, dtype=torch.int8), requires_grad=False)
    module.register_buffer(
        "weight_scale", torch.empty(old.shape[0], dtype=torch.float32), persistent=False
    )

    def quantizing_loader(param, loaded_weight, shard_id=None):
        q, scale = quantize_rows(loaded_weight)
        loader(param, q, shard_id)
        load_scale(module.weight_scale, scale, shard_id)

    weight.weight_loader = quantizing_loader
    module.weight = weight


def set_int8_weight_(module: nn.Module, weight: torch.Tensor) -> None:
    """Quantize `weight` (float, this rank's [N, K] exactly) into a module made int8 by
    `quantize_model_`: its int8 `weight` and its `weight_scale` (dummy weights; a checkpoint
    goes through the weight loaders, which cut this rank's slice out of a whole tensor)."""
    q, scale = quantize_rows(weight)
    module.weight.data.copy_(q)
    module.weight_scale.copy_(scale)


def quantize_model_(model: nn.Module, method: str | None) -> nn.Module:
    """Apply `method` to a built, not yet loaded model (in place); returns it."""
    from pagedllm.layers.linear import LinearBase
    from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    if check_quantization(method) is None:
        return model
    for module in model.modules():
        if isinstance(module, LinearBase):
            # Scales follow the rows the way a bias does (column layers: this rank's output
            # rows; row layers: the whole vector).
            _int8_layer_(
                module, lambda buf, s, shard_id, m=module: m.weight_loader(buf, s, shard_id)
            )
        elif isinstance(module, ParallelLMHead):
            _int8_layer_(module, lambda buf, s, shard_id, m=module: m._copy_vocab_rows(buf, s))
        elif isinstance(module, VocabParallelEmbedding) and module.tied_lm_head:
            module.quantize_logits = True  # the table stays; its logits copy is int8
    return model
