"""Piecewise torch.compile of a model, with the compile cache on disk.

`compilation_config.level` (vLLM's levels): 0 runs the model eagerly (the default on every
device: compiling costs minutes of start-up on a CPU and has not yet been measured to pay off
on a GPU here), 3 compiles it piecewise. Piecewise as in vLLM: the attention layers stay out
of the graphs (their backends pick kernels from per-step metadata in Python, which a graph
would specialize on and recompile for), and each decoder block is compiled around them, with
dynamic token counts; the blocks share one compiled code (no compile per layer). What a
block runs besides attention (norms with their residual adds, the q/k/v and MLP GEMMs, rotary
embedding, SiLU * up) is what Inductor fuses. On the CPU, bf16 models run pagedllm's native
kernels (`pagedllm/ops`) instead, which Dynamo cannot trace: level 3 there is an error. fp32
models compile: inside a graph the layers take their PyTorch code for the elementwise work
(`ops.row_ops` is None while compiling), and the fp32 panel GEMM is one opaque call (it has a
fake, `ops/build.py`).

Inductor's FX-graph cache stays on and lives under `compilation_config.cache_dir` (default
`$XDG_CACHE_HOME/pagedllm/torch_compile`, else `~/.cache/pagedllm/torch_compile`) instead of
a temporary directory, so a restart loads the compiled graphs instead of compiling again.
An explicit `TORCHINDUCTOR_CACHE_DIR` in the environment is kept when no cache_dir is given.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.config import CompilationConfig
from pagedllm.ops import cpu_ops

logger = logging.getLogger(__name__)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedllm", "torch_compile")


def configure_compile_cache(config: CompilationConfig) -> str:
    """Point Inductor's on-disk caches at the configured directory; returns it."""
    import torch._inductor.config as inductor_config

    if config.cache_dir is not None:
        cache_dir = os.path.join(config.cache_dir, "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    else:
        default = os.path.join(default_cache_dir(), "inductor")
        cache_dir = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default)
    inductor_config.fx_graph_cache = True
    return cache_dir


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks holding the attention layers: the elements of the first
    ModuleList whose first element contains an `Attention`."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            if any(isinstance(m, Attention) for m in module[0].modules()):
                return list(module)
    return []


def compile_model(model: nn.Module, config: CompilationConfig) -> None:
    """Compile `model` in place as `config.level` says (see the module docstring)."""
    if config.level == 0:
        return
    blocks = decoder_blocks(model)
    if not blocks:
        raise ValueError(
            f"compilation_config level={config.level}: {type(model).__name__} has no "
            "decoder blocks with attention layers to compile around"
        )
    weight = next(model.parameters())
    if weight.is_cpu and weight.dtype == torch.bfloat16 and cpu_ops() is not None:
        raise ValueError(
            f"compilation_config level={config.level}: on the CPU, bf16 models run pagedllm's "
            "native kernels (pagedllm/ops), which torch.compile cannot trace and which already "
            "fuse what it would; use level 0, dtype float32, or PAGEDLLM_CPU_KERNELS=0"
        )
    cache_dir = configure_compile_cache(config)
    for layer in model.modules():
        if isinstance(layer, Attention):
            # A graph break: the backend runs eagerly between two compiled pieces.
            layer.forward = torch.compiler.disable(layer.forward)
    for block in blocks:
        block.compile(dynamic=True, backend=config.backend)
    logger.info(
        "torch.compile level %d (%s) of %d decoder blocks; compile cache in %s",
        config.level,
        config.backend,
        len(blocks),
        cache_dir,
    )
