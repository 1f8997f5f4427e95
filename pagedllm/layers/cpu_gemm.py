"""CPU GEMMs on weights laid out once, after loading, for the kernel that multiplies them.

Three layouts, chosen per weight by `pack_linear_weight_` (called by the layers'
`process_weights_after_loading`):

- **Panels** (`weight_panels`, pagedllm's own C++ kernels, `pagedllm/ops/csrc/gemm*.h`): bf16
  weights on CPUs with AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake, and Intel's AMX CPUs,
  Sapphire Rapids on, where products of two rows or more run on AMX tiles, `gemm_amx.h`).
  One layout serves every batch size: it streams the weights at memory bandwidth for
  decode-sized batches (oneDNN reaches ~40-60% of it at M = 1) and matches or beats oneDNN's
  throughput for large ones (on AMX: 1.1-3x oneDNN's AMX kernels on SmolLM2's projections,
  BENCHMARKS.md). int8 weights (`weight_scale` set, `layers/quantization.py`) go to the W8A16 kernel
  (`weight_colsum` beside them), with AVX512-VNNI or, without it, AVX2: in a bf16 or an fp32
  model. fp32 weights on AVX2 + FMA CPUs without AVX-512, and bf16 weights on AVX2 + FMA CPUs
  where oneDNN has no bf16 path (`gemm_f32.h`, fp32 arithmetic; bf16 weights are widened as
  they are loaded, so they stream half the bytes): there oneDNN streams fp32 weights at
  ~35-65% of the memory bandwidth at decode sizes and emulates bf16 GEMMs 2-6x slower than
  fp32; with AVX-512, oneDNN's wider FMAs are kept. These panels compute a row's result in an
  order fixed by K (batch-invariant, like the AVX512-BF16 ones without AMX; on AMX a row's
  sums take another order in a batch of two or more than alone, the last bits of fp32).
- **oneDNN prepacked** (`weight_packed`): bf16 weights on other x86 CPUs with oneDNN's bf16
  path (AVX-512 without its BF16 extension, AVX-NE-CONVERT), and fp32 weights
  on the other CPUs with oneDNN (as vLLM's CPU backend runs them). `F.linear` on a row-major
  bf16 weight would reorder it on every call; reordering once is 1.5-2.5x faster at decode
  sizes and bit-identical. For fp32, `F.linear` takes MKL's GEMM: oneDNN on the packed weight
  is 1.1-1.8x faster at M = 1 and 1.8-4.4x at M = 4 (BENCHMARKS.md, "The fp32 fast path on an
  AVX2 CPU"), and differs from it in the order of the fp32 sums (the last bits; greedy tokens
  still match transformers' fp32 ones, as the oracle tests check).
- **Plain** `F.linear`: everything when `PAGEDLLM_CPU_PACK_WEIGHTS=0` (then fp32 weights
  compute exactly as transformers does) or without oneDNN. int8 weights without the native
  kernel take `int8_linear`, the PyTorch reference (the same numbers).

`panel_kernel` decides which panel kernel (if any) a weight dtype gets on this CPU;
`pack_linear_weight_` names the layout's kernel in `module.cpu_gemm` ("bf16", "avx2", "int8",
"onednn"; None: plain), a class attribute of the modules that call `packed_linear` (as is
`batch_invariant`). A packed copy replaces the plain weight (whose storage is freed), so
packing costs no memory; only `packed_linear` reads it. The exception is a tied LM head, which is the embedding table
as well: it keeps its plain weight for the lookups and gets a packed copy for the logits
(`keep_plain`). `PAGEDLLM_CPU_KERNELS=0` disables the panels (pure PyTorch).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pagedllm.config import cpu_has_fast_bf16, env_flag
from pagedllm.layers.batch_invariant import linear_by_rows
from pagedllm.layers.quantization import int8_linear
from pagedllm.ops import cpu_ops

logger = logging.getLogger(__name__)

PANEL = 64  # output channels per panel (gemm.h's kPanel)
INT8_MAX_K = 65536  # gemm_int8.h's kMaxInt8K: its int32 sums are exact up to here


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN prepacking applies to this weight: fp32 wherever PyTorch has oneDNN;
    bf16 where oneDNN has a bf16 path (AVX-512 or AVX-NE-CONVERT; on an AVX2-only CPU a bf16
    weight stays plain for `F.linear`)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if not env_flag("PAGEDLLM_CPU_PACK_WEIGHTS", True) or not _onednn_packing():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_has_fast_bf16())


@functools.cache
def _onednn_packing() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


@functools.cache
def _panel_kernel_on_this_cpu(dtype: torch.dtype) -> str | None:
    """Which panel GEMM runs weights of this dtype on this CPU: "bf16" (AVX512-BF16, with AMX
    tiles where the CPU has them), "avx2" (AVX2 + FMA: fp32 without AVX-512, where oneDNN
    has wider vectors; bf16 where oneDNN has no bf16 path, `cpu_has_fast_bf16`, and would
    emulate it), "int8" (AVX512-VNNI, else AVX2), or None (see the module docstring)."""
    ops = cpu_ops()
    if ops is None:
        return None
    avx2 = ops.cpu_has_avx2_fma()
    if dtype == torch.int8:
        return "int8" if ops.cpu_has_avx512_vnni() or avx2 else None
    if dtype == torch.float32:
        return "avx2" if avx2 and not torch.cpu._is_avx512_supported() else None
    if dtype != torch.bfloat16:
        return None
    if ops.cpu_has_avx512_bf16():
        return "bf16"
    return "avx2" if avx2 and not cpu_has_fast_bf16() else None


# Inputs per k-group of each panel kernel's layout (`to_panels`).
_PANEL_GROUP = {"bf16": 2, "avx2": 1, "int8": 4}


def panel_kernel(dtype: torch.dtype) -> str | None:
    """The panel GEMM for weights of `dtype` here, None if none (or PAGEDLLM_CPU_PACK_WEIGHTS=0)."""
    if not env_flag("PAGEDLLM_CPU_PACK_WEIGHTS", True):
        return None
    return _panel_kernel_on_this_cpu(dtype)


def bf16_panels_available() -> bool:
    """Whether bf16 weights go to a panel kernel on this CPU (either kind)."""
    return panel_kernel(torch.bfloat16) is not None


def can_use_panels(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in], bf16, fp32, or int8 with scales) goes to a panel kernel."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    kind = panel_kernel(weight.dtype)
    if kind is None:
        return False
    k = weight.shape[1]
    return k <= INT8_MAX_K if kind == "int8" else k % _PANEL_GROUP[kind] == 0


def to_panels(weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """[N, K] -> [ceil(N / 64), K / g, 64, g]: panels of 64 output channels, k-groups of g
    inputs inside (each kernel's `_PANEL_GROUP`; default 4 bytes' worth: bf16 k-pairs, int8
    k-quads, fp32 single inputs); zero rows pad N to a whole panel, and zero columns K to
    whole groups."""
    n, k = weight.shape
    group = 4 // weight.element_size() if group is None else group
    padded = F.pad(weight, (0, -k % group, 0, -n % PANEL)) if n % PANEL or k % group else weight
    words = padded.contiguous()
    if group * weight.element_size() == 4:
        # A 4-byte k-group moves as one int32: a plain 2-D transpose per panel, ~5x faster
        # than permuting its elements separately.
        words = words.view(torch.int32)
    elif group != 1:
        raise ValueError(f"k-groups of {group} {weight.dtype} values are not a kernel's layout")
    words = words.reshape(-1, PANEL, words.shape[1])
    return (
        words.transpose(1, 2)
        .contiguous()
        .view(weight.dtype)
        .reshape(-1, words.shape[2], PANEL, group)
    )


def from_panels(panels: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
    """Inverse of `to_panels`: the [n, k] weight (k: all of the panels' K by default)."""
    full = panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * panels.shape[3])
    return full[:n] if k is None else full[:n, :k]


def pack_linear_weight_(
    module: torch.nn.Module, keep_plain: bool = False, weight: torch.Tensor | None = None
) -> bool:
    """Lay out `module.weight` ([out, in]) for its CPU kernel (see the module docstring), name
    the kernel in `module.cpu_gemm` and free the plain copy's storage, unless `keep_plain` (a
    tied LM head: the embedding looks rows up in it). `weight`: lay out this one instead (a
    tied head's int8 copy). Returns whether it packed (no-op where no packing applies)."""
    activations = getattr(module, "activation_dtype", module.weight.dtype)
    weight = module.weight.data if weight is None else weight
    kind = panel_kernel(weight.dtype) if can_use_panels(weight) else None
    # The activations each kernel multiplies: int8 weights take either, the others their own.
    takes = (torch.bfloat16, torch.float32) if kind == "int8" else (weight.dtype,)
    if kind is not None and activations in takes:
        # Buffers (not plain attributes): torch.compile then takes them as inputs of one graph
        # for every layer instead of constants that differ per layer.
        panels = to_panels(weight, _PANEL_GROUP[kind])
        module.register_buffer("weight_panels", panels, persistent=False)
        if kind == "int8":  # sum_k q[n, k], for the activations' zero points
            colsum = weight.sum(dim=1, dtype=torch.int32)
            colsum = F.pad(colsum, (0, panels.shape[0] * PANEL - len(colsum)))
            module.register_buffer("weight_colsum", colsum, persistent=False)
    elif weight.dtype != torch.int8 and can_pack(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        module.register_buffer("weight_packed", packed, persistent=False)
        kind = "onednn"
    else:
        return False
    module.cpu_gemm = kind
    module.weight_out_features = weight.shape[0]
    if not keep_plain:
        module.weight.data = torch.empty(0, dtype=weight.dtype)
    return True


@torch.library.custom_op("pagedllm_compile::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product with a weight prepacked by `_reorder_linear_weight`, as one opaque op
    inside torch.compile graphs: Inductor's own lowering of `mkldnn._linear_pointwise` takes
    only weights that are constants of the graph, and the packed weights are buffers (inputs
    of the one graph every decoder block shares), so it failed to compile fp32 models."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def packed_linear(
    module: torch.nn.Module,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the module's weight W in whichever layout it has (int8
    weights: the W8A16 product of `layers/quantization.py`); the result is in `out_dtype`
    (default: x's dtype)."""
    flat = x.reshape(-1, x.shape[-1])
    if module.batch_invariant:  # row by row (layers/batch_invariant.py)
        y = linear_by_rows(lambda row: _linear_2d(module, row, bias, out_dtype), flat)
    else:
        y = _linear_2d(module, flat, bias, out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _linear_2d(
    module: torch.nn.Module,
    flat: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    # On the decode path of every layer: one attribute says which kernel (no getattr probes
    # of absent attributes, which cost ~10 us a call through nn.Module's __getattr__).
    kind = module.cpu_gemm
    out_fp32 = out_dtype == torch.float32
    if kind == "avx2":  # fp32 or bf16 weights on AVX2 + FMA
        return torch.ops.pagedllm.linear_avx2.default(
            flat.contiguous(), module.weight_panels, bias, module.weight_out_features, out_fp32
        )
    if kind == "int8":
        return torch.ops.pagedllm.linear_int8.default(
            flat.contiguous(),
            module.weight_panels,
            module.weight_scale,
            module.weight_colsum,
            bias,
            module.weight_out_features,
            out_fp32,
        )
    if kind == "bf16":
        return torch.ops.pagedllm.linear.default(
            flat.contiguous(), module.weight_panels, bias, module.weight_out_features, out_fp32
        )
    if kind == "onednn":
        if torch.compiler.is_compiling():  # an opaque call in the graph (onednn_linear)
            y = onednn_linear(flat.contiguous(), module.weight_packed, bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(
                flat.contiguous(), module.weight_packed, bias, "none", [], ""
            )
    elif module.weight.dtype == torch.int8:  # int8 without the native kernel: the reference
        return int8_linear(flat, module.weight, module.weight_scale, bias, out_dtype or flat.dtype)
    else:
        y = F.linear(flat, module.weight, bias)
    return y.to(out_dtype or flat.dtype)
