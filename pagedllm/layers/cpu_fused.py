"""A pre-norm decoder layer in native calls on the CPU (`ops/csrc/ops.cpp`): two around its
attention, which stays the backend's (`attention_in`, `attention_out_mlp`); and, on a
decode-only step of `CpuAttentionBackend` without a KV connector, every layer of the model (of
its pipeline stage) in one call, each a whole layer with the backend's K/V write and decode
kernel (`FusedStack`, ops.cpp's `DecodeStack` running `decoder_layer_decode` per layer).

`attention_in`: input RMSNorm (with the residual add), the QKV projection, the per-head q/k
RMSNorm where the model has one (Qwen3) and RoPE;
`attention_out_mlp`: the output projection, post-attention RMSNorm (with the residual add),
gate/up projection, SiLU x mul and down projection. They run the kernels the layer's modules
would run, in the same order, so the outputs are bit for bit the same; what they save is the
Python between the ops (module calls, buffer look-ups, one dispatcher entry per op): on a
30-layer model's batch-1 decode step that was ~6 ms, as much as the int8 GEMMs themselves.

`FusedStack` binds each layer's arguments once (weights, norms, sizes) and takes a step's
(hidden rows, positions, KV caches, block table) in one call: a call a layer parsed ~40
arguments from Python each (~50 us a layer on a 30-layer model's batch-1 step); SmolLM2's
batch-1 decode got 1.06x (int8) and 1.09x (bf16) faster. It applies where every layer has a
plan; otherwise decode-only steps go layer by layer as other steps do.

`layer_plan(layer)` decides once per layer (at its first forward, after the weights are packed)
whether the layer qualifies: every projection on a native panel kernel with one
tensor-parallel rank, native norms (the per-head q/k norms included), plain RoPE and SiLU, no
batch-invariant mode. Otherwise it returns None and the layer keeps its modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.ops import cpu_ops

# The panel kernels a fused layer runs (ops.cpp `project`: the kind number it takes).
_KINDS = {"avx2": 0, "int8": 1, "bf16": 2}
# The fused ops' q/k norm arguments (weights, eps) for a layer without them.
_NO_QK_NORM = (None, None, 0.0)


def _projection(module: Any, dtype: torch.dtype) -> tuple | None:
    """(kind, panels, scale, colsum, bias, n): a projection's arguments, or None when it
    does not run on a panel kernel with `dtype` activations on one rank."""
    kind = _KINDS.get(getattr(module, "cpu_gemm", None))
    if kind is None or module.batch_invariant or module.tp_size != 1:
        return None
    panels = module.weight_panels
    if kind != _KINDS["int8"] and panels.dtype != dtype:
        return None
    scale = module.weight_scale if kind == _KINDS["int8"] else None
    colsum = module.weight_colsum if kind == _KINDS["int8"] else None
    return (kind, panels, scale, colsum, module.bias, module.weight_out_features)


@dataclass(frozen=True)
class FusedLayer:
    """A decoder layer's arguments for the fused ops, gathered once."""

    dtype: torch.dtype  # the activations' (the norms' weights')
    head: tuple  # attention_in's arguments after (x, residual)
    tail: tuple  # attention_out_mlp's arguments after (attn, residual)
    projections: tuple  # _projection's tuples: qkv, o, gate_up, down
    norms: tuple  # (input norm, post-attention norm) RMSNorm modules
    qk_norm: tuple  # (q_norm weight, k_norm weight, eps), or _NO_QK_NORM without

    def forward(
        self,
        layer: Any,  # the LlamaDecoderLayer
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's forward: (mlp output, residual stream)."""
        ops = torch.ops.pagedllm
        attn = layer.self_attn.attn
        rope = layer.self_attn.rotary_emb
        rope_args = (positions, rope.cos_sin_cache, rope.head_size, rope.rotary_dim)
        qkv = ops.attention_in.default(hidden, residual, *self.head, *rope_args, *self.qk_norm)
        if residual is None:
            residual = hidden
        q_size, kv_size = layer.self_attn.q_size, layer.self_attn.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        out = attn(q, k, v.contiguous(), attn_metadata)
        return ops.attention_out_mlp.default(out, residual, *self.tail), residual


def layer_plan(layer: Any) -> FusedLayer | None:
    """The fused ops' arguments for a `LlamaDecoderLayer`, or None where they do not apply
    (see the module docstring)."""
    if cpu_ops() is None:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm for n in norms):  # EAGLE's first layer: no input norm
        return None
    dtype = norms[0].weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    head_norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else ()
    if any(type(n) is not RMSNorm for n in head_norms):
        return None
    if any(
        n.batch_invariant or n.weight.dtype != dtype or n.weight.device.type != "cpu"
        for n in (*norms, *head_norms)
    ):
        return None
    if (
        type(mlp.act_fn) is not SiluAndMul
        or type(attn.rotary_emb).forward is not RotaryEmbedding.forward
    ):
        return None
    projections = [
        _projection(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ]
    if any(p is None for p in projections):
        return None
    qkv, o, gate_up, down = projections
    n_in, n_post = norms
    # One eps for both: LlamaAttention builds the two norms from the config's rms_norm_eps.
    qk_norm = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if head_norms else None
    return FusedLayer(
        dtype=dtype,
        head=(n_in.weight, n_in.eps, *qkv, attn.q_size, attn.kv_size),
        tail=(*o, n_post.weight, n_post.eps, *gate_up, *down),
        projections=tuple(projections),
        norms=norms,
        qk_norm=qk_norm or _NO_QK_NORM,
    )


class FusedStack:
    """Decoder layers (each with a `FusedLayer` plan) run by one native call on a decode-only
    step of `CpuAttentionBackend` without a KV connector; other steps go layer by layer."""

    def __init__(self, layers: list, plans: list[FusedLayer]) -> None:
        self.dtype = plans[0].dtype
        self.attns = [layer.self_attn.attn for layer in layers]
        self.native = torch.classes.pagedllm.DecodeStack()
        for layer, plan in zip(layers, plans):
            attn, rope = layer.self_attn, layer.self_attn.rotary_emb
            tensors, ints = [], []
            for kind, panels, scale, colsum, bias, n in plan.projections:
                tensors += [panels, scale, colsum, bias]
                ints += [kind, n]
            n_in, n_post = plan.norms
            q_norm, k_norm, qk_eps = plan.qk_norm
            tensors += [n_in.weight, n_post.weight, rope.cos_sin_cache, q_norm, k_norm]
            tensors.append(attn.attn.kv_scales_tensor)  # read each step (set_kv_scales)
            ints += [attn.q_size, attn.kv_size, rope.head_size, rope.rotary_dim]
            self.native.add_layer(tensors, ints, [n_in.eps, n_post.eps, attn.attn.scale, qk_eps])

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer, or None where this step goes layer by layer."""
        if hidden.dtype != self.dtype or hidden.dim() != 2:
            return None
        first = self.attns[0]
        decode_only = getattr(first.backend, "decode_only", None)
        if decode_only is None or any(a.kv_connector is not None for a in self.attns):
            return None
        d = decode_only(attn_metadata, hidden.shape[0])
        if d is None:
            return None
        return self.native.decode(
            hidden,
            residual,
            positions,
            [a.kv_cache for a in self.attns],
            attn_metadata.slot_mapping,
            d.block_table,
            d.seq_lens,
            d.max_seq_len,
        )


def stack_plan(layers: list) -> FusedStack | None:
    """A `FusedStack` of `LlamaDecoderLayer`s when every one has a plan (their
    `fused_plan()`, see `layer_plan`) with one activation dtype, else None."""
    plans = [layer.fused_plan() for layer in layers]
    if not plans or any(p is None or p.dtype != plans[0].dtype for p in plans):
        return None
    return FusedStack(layers, plans)
