"""Picks the attention backend: the seam where device-specific attention plugs in.

Backends, by vLLM's names:
- `TORCH_SDPA` (`TorchAttentionBackend`: SDPA over gathered paged blocks): runs on the CPU and
  CUDA; the reference every other backend is tested against.
- `CPU_ATTN` (`CpuAttentionBackend`: the torch backend with decodes attended by the native
  paged kernel of `pagedllm.ops`): the CPU default for bf16 and fp32 models whose KV cache
  the native kernels take (`NATIVE_KV_DTYPES`: the model's dtype or fp8) when the native ops
  are available; otherwise the CPU gets TORCH_SDPA.
- `TRITON_ATTN` (`TritonAttentionBackend`: the Triton kernels, over caches in the model's
  dtype or fp8): the CUDA default. On the CPU it runs only in Triton's interpreter
  (`TRITON_INTERPRET=1`, for tests).

- `BATCH_INVARIANT` (`BatchInvariantAttentionBackend`: one fixed summation order per query
  row): only, and always, with `batch_invariant=True` (never named by hand).

A choice made explicitly, by the engine argument `attention_backend` (`--attention-backend`)
or else the environment variable `PAGEDLLM_ATTENTION_BACKEND` (vLLM's
`VLLM_ATTENTION_BACKEND`), wins over the default; one that cannot run is a ValueError.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.ops import NATIVE_DTYPES, NATIVE_KV_DTYPES, cpu_ops
from pagedllm.ops.triton import HAS_TRITON, triton_usable

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("TORCH_SDPA", "CPU_ATTN", "TRITON_ATTN")
ATTENTION_BACKEND_ENV = "PAGEDLLM_ATTENTION_BACKEND"


def check_attention_backend_name(name: str) -> str:
    """`name` upper-cased if it is a known backend; else a ValueError naming it."""
    if name.upper() not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {list(ATTENTION_BACKENDS)}")
    return name.upper()


def get_attn_backend(
    device: str | torch.device,
    kv_cache_dtype: torch.dtype | None = None,
    attention_backend: str | None = None,
    batch_invariant: bool = False,
    model_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The attention backend for `device` ("cpu", "cuda", "cuda:1" or a torch.device), a KV
    cache of `kv_cache_dtype` and queries of `model_dtype` (None: `kv_cache_dtype`'s):
    `attention_backend`, else $PAGEDLLM_ATTENTION_BACKEND, else the device's default.
    `batch_invariant`: `BATCH_INVARIANT` (no other may be named)."""
    device_type = torch.device(device).type
    if batch_invariant:
        return _batch_invariant_backend(device_type, attention_backend)
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} has no attention backend; use 'cpu' or 'cuda'")
    native = kv_cache_dtype in NATIVE_KV_DTYPES and (model_dtype or kv_cache_dtype) in NATIVE_DTYPES
    name = attention_backend or os.environ.get(ATTENTION_BACKEND_ENV) or None
    if name is None:
        if device_type == "cuda":
            if triton_usable(device):
                return _triton_backend()
            logger.warning("Triton is not installed: CUDA attention falls back to TORCH_SDPA")
            return TorchAttentionBackend()
        ops = cpu_ops() if native else None
        return CpuAttentionBackend(ops) if ops is not None else TorchAttentionBackend()
    name = check_attention_backend_name(name)
    if name == "TORCH_SDPA":
        return TorchAttentionBackend()
    if name == "CPU_ATTN":
        ops = cpu_ops() if device_type == "cpu" and native else None
        if ops is None:
            raise ValueError(
                "attention_backend='CPU_ATTN' needs the CPU, a bfloat16 or float32 model with a "
                "KV cache in its dtype or fp8 (kv_cache_dtype) and pagedllm's native ops "
                "(pagedllm.ops; PAGEDLLM_CPU_KERNELS not 0)"
            )
        return CpuAttentionBackend(ops)
    if not triton_usable(device):
        why = (
            "the triton package is not installed"
            if not HAS_TRITON
            else "Triton runs on the CPU only in its interpreter (TRITON_INTERPRET=1)"
            if device_type == "cpu"
            else "TRITON_INTERPRET=1 makes Triton run on CPU tensors only"
        )
        raise ValueError(f"attention_backend='TRITON_ATTN' cannot run on {device_type}: {why}")
    return _triton_backend()


def _batch_invariant_backend(device_type: str, attention_backend: str | None) -> AttentionBackend:
    from pagedllm.attention.batch_invariant_backend import BatchInvariantAttentionBackend

    named = attention_backend or os.environ.get(ATTENTION_BACKEND_ENV)
    if named is not None:
        raise ValueError(
            f"attention_backend={named!r} cannot be combined with batch_invariant=True, "
            "which runs its own attention (BATCH_INVARIANT)"
        )
    if device_type != "cpu":
        raise ValueError("batch_invariant=True runs on the CPU only (not verified on CUDA)")
    return BatchInvariantAttentionBackend()


def _triton_backend() -> AttentionBackend:
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
