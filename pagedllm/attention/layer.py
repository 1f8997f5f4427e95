"""The attention layer models call: reshapes q/k/v into heads and hands them to the backend
together with this layer's own paged KV-cache tensor."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales
from pagedllm.layers.cpu_memory import anonymous_bytes


class Attention(nn.Module):
    """Paged attention over this layer's KV cache (no parameters of its own).

    Built by the model with its local head counts (per tensor-parallel rank). The model runner
    binds `kv_cache` (shaped by `backend.get_kv_cache_shape(num_blocks, block_size,
    num_kv_heads, head_size)`) and `backend` after the model is built, before the first
    forward; `bind_kv_caches` does it for a whole model. `prefix` is the layer's dotted name
    in the model (e.g. `model.layers.0.self_attn.attn`), a stable key for per-layer caches.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{prefix}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # A KV connector's worker side (distributed/kv_transfer/), bound by the model runner
        # when one is configured: it loads this layer's blocks before attention and saves them
        # after. None (the usual case) costs one attribute check per layer.
        self.kv_connector: Any = None
        # The scales of an fp8 cache's keys and values (attention/fp8_kv.py): 1 unless set
        # (`set_kv_scales`: calculate_kv_scales). `kv_scales_tensor` holds the same two values
        # for the native fused decode layers (layers/cpu_fused.py), which read it each step.
        self.kv_scales: KVScales = UNIT_SCALES
        # (On the CPU whatever device the model is built under: only the CPU's fused ops read it.)
        self.kv_scales_tensor = torch.ones(2, dtype=torch.float32, device="cpu")

    def set_kv_scales(self, scales: KVScales) -> None:
        self.kv_scales = scales
        self.kv_scales_tensor.copy_(torch.tensor([scales.k, scales.v], dtype=torch.float32))

    def forward(
        self,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, Hkv * D]
        v: torch.Tensor,  # [T, Hkv * D]
        attn_metadata: Any,  # what backend.build_metadata returned for this step
    ) -> torch.Tensor:
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_name!r} has no KV cache bound; the model runner "
                "must set layer.kv_cache and layer.backend before the first forward"
            )
        num_tokens = q.shape[0]
        connector = self.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            attn_metadata,
            self.scale,
            self.kv_scales,
        )  # [T, H, D]
        if connector is not None:
            connector.save_kv_layer(self.layer_name, self.kv_cache, attn_metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, scale={self.scale:.4g}"
        )


def get_attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention layers in module order (layer 0 first)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_caches(
    model: nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend
) -> list[Attention]:
    """Bind `kv_caches[i]` and `backend` to the model's i-th Attention layer; returns them."""
    layers = get_attention_layers(model)
    if len(layers) != len(kv_caches):
        raise ValueError(
            f"got {len(kv_caches)} KV-cache tensors for {len(layers)} attention layers"
        )
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache
        layer.backend = backend
    return layers


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all of the model's Attention layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * block_size * layer.num_kv_heads * layer.head_size * elem
        for layer in get_attention_layers(model)
    )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU, memory the OS zeroes lazily (an anonymous mapping: fresh
    pages read as zero and are committed when first written): `torch.zeros` would write every
    page up front, seconds for a default-sized cache, and commit memory no request may ever
    use. Reads of never-written slots (masked padding) still see zeros, never garbage. The
    mapping asks for transparent huge pages where the kernel offers them (madvise mode): the
    first writes into fresh blocks then fault a 2 MB page at a time instead of 4 KB (fewer,
    cheaper faults while a long prefill fills fresh blocks). An idle engine faults the rest
    in ahead of use (worker/kv_prefault.py), so the steps rarely pay for it."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return anonymous_bytes(nbytes).view(dtype).view(shape)


def allocate_kv_caches(
    model: nn.Module,
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed paged KV tensor per Attention layer of `model`, bound to it; returns them."""
    caches = [
        _zeros(
            backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size),
            dtype,
            torch.device(device),
        )
        for layer in get_attention_layers(model)
    ]
    bind_kv_caches(model, caches, backend)
    return caches
