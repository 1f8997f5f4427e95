"""A pre-norm decoder layer in native calls on the CPU (`ops/csrc/ops.cpp`): two around its
attention, which stays the backend's (`attention_in`, `attention_out_mlp`), or, on a decode-only
step of `CpuAttentionBackend` without a KV connector, one for the whole layer
(`decoder_layer_decode`, the backend's K/V write and decode kernel included).

`attention_in`: input RMSNorm (with the residual add), the QKV projection and RoPE;
`attention_out_mlp`: the output projection, post-attention RMSNorm (with the residual add),
gate/up projection, SiLU x mul and down projection. They run the kernels the layer's modules
would run, in the same order, so the outputs are bit for bit the same; what they save is the
Python between the ops (module calls, buffer look-ups, one dispatcher entry per op): on a
30-layer model's batch-1 decode step that was ~6 ms, as much as the int8 GEMMs themselves.

`layer_plan(layer)` decides once per layer (at its first forward, after the weights are packed)
whether the layer qualifies: every projection on a native panel kernel with one
tensor-parallel rank, native norms, plain RoPE and SiLU, no per-head q/k norm, no
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
        decode_only = getattr(attn.backend, "decode_only", None)
        d = None
        if decode_only is not None and attn.kv_connector is None:
            d = decode_only(attn_metadata, hidden.shape[0])
        if d is not None:  # one native call for the whole layer
            out = ops.decoder_layer_decode.default(
                hidden,
                residual,
                *self.head,
                *rope_args,
                attn.kv_cache,
                attn_metadata.slot_mapping,
                d.block_table,
                d.seq_lens,
                d.max_seq_len,
                attn.scale,
                *self.tail,
            )
            return out, hidden if residual is None else residual
        qkv = ops.attention_in.default(hidden, residual, *self.head, *rope_args)
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
    if dtype not in (torch.bfloat16, torch.float32) or attn.qk_norm:
        return None
    if any(
        n.batch_invariant or n.weight.dtype != dtype or n.weight.device.type != "cpu" for n in norms
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
    return FusedLayer(
        dtype=dtype,
        head=(n_in.weight, n_in.eps, *qkv, attn.q_size, attn.kv_size),
        tail=(*o, n_post.weight, n_post.eps, *gate_up, *down),
    )
