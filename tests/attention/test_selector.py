"""Backend choice: the device's default, the engine argument, the environment variable, and
clear errors for what cannot run."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import selector
from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.selector import ATTENTION_BACKEND_ENV, get_attn_backend
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.engine.arg_utils import EngineArgs


def test_cpu_default_is_torch_sdpa_without_the_native_kernel(monkeypatch):
    """Caches the kernel does not take (fp16), or no native build: TORCH_SDPA."""
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    assert isinstance(get_attn_backend("cpu"), TorchAttentionBackend)
    assert isinstance(get_attn_backend("cpu", torch.float16), TorchAttentionBackend)
    monkeypatch.setattr(selector, "cpu_ops", lambda: None)
    assert isinstance(get_attn_backend("cpu", torch.float32), TorchAttentionBackend)


def test_cpu_attn_explicitly(monkeypatch):
    """CPU_ATTN: the native decode kernel, for bf16 and fp32 caches on the CPU only."""
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    with pytest.raises(ValueError, match="CPU_ATTN.*bfloat16 or float32"):
        get_attn_backend("cpu", torch.float16, "CPU_ATTN")
    with pytest.raises(ValueError, match="CPU_ATTN"):
        get_attn_backend("cuda", torch.bfloat16, "CPU_ATTN")
    monkeypatch.setattr(selector, "cpu_ops", lambda: object())  # native ops available
    assert isinstance(get_attn_backend("cpu", torch.bfloat16, "cpu_attn"), CpuAttentionBackend)
    for dtype in (torch.bfloat16, torch.float32):  # the default
        assert isinstance(get_attn_backend("cpu", dtype), CpuAttentionBackend)


def test_fp8_caches_take_the_native_backend_with_bf16_and_fp32_queries_only(monkeypatch):
    """kv_cache_dtype fp8: the selector gets the cache's dtype; the native kernels take fp8
    caches with bf16 / fp32 queries, an fp16 model's go to TORCH_SDPA."""
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.setattr(selector, "cpu_ops", lambda: object())  # native ops available
    for cache in (torch.float8_e4m3fn, torch.float8_e5m2):
        for model in (torch.bfloat16, torch.float32):
            backend = get_attn_backend("cpu", cache, model_dtype=model)
            assert isinstance(backend, CpuAttentionBackend)
        backend = get_attn_backend("cpu", cache, model_dtype=torch.float16)
        assert type(backend) is TorchAttentionBackend
        with pytest.raises(ValueError, match="CPU_ATTN.*fp8"):
            get_attn_backend("cpu", cache, "CPU_ATTN", model_dtype=torch.float16)


def test_triton_takes_fp8_caches(monkeypatch, tiny_llama_dir):
    """The Triton kernels read and write fp8 caches (ops/triton/fp8.py): named with one it is
    chosen, and it stays CUDA's default."""
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.setattr(selector, "triton_usable", lambda device: True)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert get_attn_backend("cuda", fp8, model_dtype=torch.bfloat16).name == "TRITON_ATTN"
        assert get_attn_backend("cuda", fp8, "TRITON_ATTN").name == "TRITON_ATTN"
    args = EngineArgs(
        model=tiny_llama_dir, device="cpu", kv_cache_dtype="fp8", attention_backend="TRITON_ATTN"
    )
    config = args.create_engine_config()
    assert config.kv_cache_torch_dtype == torch.float8_e4m3fn
    assert config.attention_backend == "TRITON_ATTN"


def test_cuda_default_is_triton_where_triton_runs(monkeypatch):
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.setattr(selector, "triton_usable", lambda device: True)
    assert get_attn_backend("cuda:0").name == "TRITON_ATTN"
    monkeypatch.setattr(selector, "triton_usable", lambda device: False)
    assert isinstance(get_attn_backend("cuda"), TorchAttentionBackend)


def test_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "TRITON_ATTN")
    assert isinstance(get_attn_backend("cpu", torch.bfloat16, "torch_sdpa"), TorchAttentionBackend)


def test_environment_selects_triton_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "TRITON_ATTN")
    if not selector.HAS_TRITON:
        pytest.skip("triton is not installed")
    assert get_attn_backend("cpu").name == "TRITON_ATTN"


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_ATTN.*interpreter"):
        get_attn_backend("cpu", attention_backend="TRITON_ATTN")


def test_unknown_backend_names_the_value(tiny_llama_dir):
    with pytest.raises(ValueError, match="attention_backend='FLASH_ATTN'"):
        get_attn_backend("cpu", attention_backend="FLASH_ATTN")
    with pytest.raises(ValueError, match="attention_backend='nope'"):
        EngineArgs(model=tiny_llama_dir, attention_backend="nope").create_engine_config()
