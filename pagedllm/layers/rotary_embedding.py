"""Rotary position embedding (RoPE), "neox" layout: a head's first and second halves of the
rotary dims are the two coordinates of each rotated pair (transformers' `rotate_half`).

cos/sin are precomputed once for every position up to the cache length and gathered by a
`positions` tensor, so prefill and decode tokens of many requests rotate in one call. The
inverse frequencies of scaled variants (llama3, linear, yarn, ...) come from transformers'
own `ROPE_INIT_FUNCTIONS`, so they match it exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.ops import row_ops

_DEFAULT_THETA = 10000.0


def rope_parameters_from_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling parameters or None) from a transformers config, old or new shape.

    transformers >= 5 keeps everything in `config.rope_parameters` (with `rope_theta` and
    `rope_type` inside); earlier versions use `config.rope_theta` plus an optional
    `config.rope_scaling` dict whose type key may be spelled `type`.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        theta = getattr(hf_config, "rope_theta", None)
    else:
        params = dict(params)
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    theta = float(theta if theta is not None else _DEFAULT_THETA)
    params.pop("rope_theta", None)
    rope_type = params.pop("type", None)
    rope_type = params.get("rope_type", rope_type) or "default"
    params["rope_type"] = rope_type
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = partial
    if rope_type == "default" and set(params) <= {"rope_type", "partial_rotary_factor"}:
        return theta, None
    return theta, params


def _compute_inv_freq(
    rotary_dim: int, max_position: int, base: float, rope_parameters: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention scaling applied to cos/sin)."""
    rope_type = (rope_parameters or {}).get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        return 1.0 / (base**exponents), 1.0
    # PretrainedConfig, not LlamaConfig: the latter's import costs ~1 s more (torch._dynamo).
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported: default, "
            + ", ".join(sorted(ROPE_INIT_FUNCTIONS))
        )
    scaling = {k: v for k, v in rope_parameters.items() if k != "partial_rotary_factor"}
    # A one-head config whose head is exactly the rotary part: the init functions read only
    # the rope fields, head_dim and max_position_embeddings from it.
    shim = PretrainedConfig(
        hidden_size=rotary_dim,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=rotary_dim,
        max_position_embeddings=max_position,
        rope_parameters=scaling | {"rope_theta": base},
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](shim, None)
    return inv_freq.to(torch.float32), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rotary_dim` dims of every query and key head.

    `cos_sin_cache` [cache_len, rotary_dim] float32 holds cos in its first half and sin in its
    second half for positions `0 .. cache_len - 1` (already multiplied by the variant's
    attention scaling).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        cache_len: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2 != 0:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_size={head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.cache_len = cache_len
        t = torch.arange(cache_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))  # [cache_len, rotary_dim // 2]
        cache = torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], -1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, head_size]; cos/sin [T, 1, rotary_dim // 2]
        rot = x[..., : self.rotary_dim]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if self.rotary_dim == self.head_size:
            return out
        return torch.cat([out, x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H * head_size]; key [T, Hkv * head_size] -> same shapes.
        bf16 and fp32 rows on the CPU are rotated in place by the native kernel (same
        roundings, bit for bit)."""
        ops = row_ops(query) if key.dtype == query.dtype else None
        if ops is not None:
            ops.rotary_embedding(
                positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim
            )
            return query, key
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [T, rotary_dim]
        # transformers casts cos/sin to the activation dtype before rotating; so do we.
        cos, sin = cos_sin.to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
        q = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin)
        k = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin)
        return q.reshape(query.shape), k.reshape(key.shape)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, cache_len={self.cache_len}"
        )


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float = _DEFAULT_THETA,
    rope_parameters: dict[str, Any] | None = None,
    *,
    rope_scaling: dict[str, Any] | None = None,
    cache_len: int | None = None,
) -> RotaryEmbedding:
    """Build a RotaryEmbedding.

    `max_position` is the model's `max_position_embeddings` (some scaled variants derive their
    factor from it); `cache_len` (default `max_position`) is how many positions get a
    precomputed cos/sin row. `rope_parameters` (or its older name `rope_scaling`) is the
    scaling dict with `rope_type` (or `type`), e.g. `{"rope_type": "llama3", "factor": 8.0,
    ...}`; None or type `default` means plain RoPE. A `partial_rotary_factor` inside it is
    ignored here: pass the resulting `rotary_dim` instead.
    """
    params = rope_parameters if rope_parameters is not None else rope_scaling
    if params is not None:
        params = dict(params)
        params.pop("rope_theta", None)
        rope_type = params.pop("type", None)
        params["rope_type"] = params.get("rope_type", rope_type) or "default"
    inv_freq, attention_scaling = _compute_inv_freq(rotary_dim, max_position, base, params)
    return RotaryEmbedding(
        head_size, rotary_dim, cache_len or max_position, inv_freq, attention_scaling
    )
