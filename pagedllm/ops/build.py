"""Build (once) and load the C++ operators in `pagedllm/ops/csrc/`.

The extension is compiled with PyTorch's own tooling (`torch.utils.cpp_extension.load`, ninja)
into a directory named by a hash of the sources, the compiler flags, PyTorch's version and the
Python ABI, under `$PAGEDLLM_CACHE_DIR` (default `~/.cache/pagedllm`): the first start on a
machine compiles it (about 10-20 s of CPU), every later start only loads the library.
`make venv` builds it at install time (`python -m pagedllm.ops`). The binary runs on any
x86-64 CPU: the kernels pick AVX-512-BF16, AVX-512, AVX2 or baseline code at run time, and
callers ask `cpu_has_avx512_bf16()` / `cpu_has_avx512_vnni()` before using the panel GEMMs.

`PAGEDLLM_CPU_KERNELS=0` turns the native path off (pure PyTorch everywhere).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from pagedllm.config import env_flag

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
EXT_NAME = "pagedllm_cpu_ops"
# -fopenmp: ATen's parallel_for is inline OpenMP; the library then links libgomp.so.1, which
# resolves to the copy PyTorch already loaded (one thread pool for both).
# -ffp-contract=off: a * b - c * d stays two rounded products and a rounded difference, as
# PyTorch computes it (GCC would fuse it into an FMA, a different rounding); the kernels'
# explicit FMA intrinsics are unaffected. -fno-trapping-math: float selects (exp's clamp, the
# bf16 NaN test) become blends, so the loops around them vectorize (values are unchanged).
CFLAGS = [
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-Wno-unused-function",
]


def kernels_enabled() -> bool:
    """Whether the native CPU path is wanted (`PAGEDLLM_CPU_KERNELS`, default on)."""
    return env_flag("PAGEDLLM_CPU_KERNELS", True)


def build_dir() -> Path:
    """Where this exact build lives: keyed by sources, flags, torch and Python versions, and
    where the sources are (PyTorch's extension loader writes their absolute paths into its
    ninja file, so two checkouts of the same sources sharing one directory rebuilt it each
    time the other had built it: a ~20 s start-up)."""
    digest = hashlib.sha256()
    digest.update(str(CSRC.resolve()).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {sys.platform}".encode())
    root = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")
    return root / "cpu_ops" / digest.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """Compile the extension if its build directory has none; load it; return the library.
    A directory whose build finished (its marker file written after the first load) is
    loaded straight away: PyTorch's extension loader imports setuptools and runs ninja to
    find out the same (~0.2 s of every engine's start-up)."""
    out = build_dir()
    library = out / f"{EXT_NAME}.so"
    marker = out / "built"
    if marker.exists() and library.exists():
        torch.ops.load_library(str(library))
        return library

    from torch.utils.cpp_extension import load

    out.mkdir(parents=True, exist_ok=True)
    load(
        name=EXT_NAME,
        sources=[str(CSRC / "ops.cpp")],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(CSRC)],
        build_directory=str(out),
        is_python_module=False,
        verbose=verbose,
    )
    marker.touch()
    return library


def _registered() -> bool:
    try:
        torch.ops.pagedllm.cpu_has_avx512_bf16  # noqa: B018 (resolves only if registered)
    except (AttributeError, RuntimeError):
        return False
    return True


def _register_fake_gemm() -> None:
    """Shape functions for the AVX2 and int8 GEMMs, so that torch.compile (compilation level 3,
    which fp32 CPU models allow) keeps each as one opaque call inside its graphs."""

    @torch.library.register_fake("pagedllm::linear_avx2")
    def _(x, w, bias, n, out_fp32):
        return x.new_empty((x.shape[0], n), dtype=torch.float32 if out_fp32 else x.dtype)

    @torch.library.register_fake("pagedllm::linear_int8")
    def _(x, w, w_scale, colsum, bias, n, out_fp32):
        return x.new_empty((x.shape[0], n), dtype=torch.float32 if out_fp32 else x.dtype)


@functools.cache
def cpu_ops() -> Any | None:
    """`torch.ops.pagedllm`, built and loaded on first use; None if disabled or unavailable."""
    if not kernels_enabled() or sys.platform != "linux":
        return None
    if not _registered():  # not loaded yet (a second library would register the ops twice)
        try:
            build()
        except Exception as e:  # no compiler, no ninja, a failed build: stay on PyTorch
            logger.warning("pagedllm CPU kernels unavailable, using PyTorch ops (%s)", e)
            return None
    # PAGEDLLM_CPU_AMX=0: the AVX-512 kernels even where the CPU has AMX tiles.
    torch.ops.pagedllm.cpu_allow_amx(env_flag("PAGEDLLM_CPU_AMX", True))
    # The one-row int8 kernel's switches, where set (the same bits either way; gemm_int8.h):
    # PAGEDLLM_CPU_INT8_ROW_WORDS=1/0, int16 words or two byte rows (byte rows by default);
    # PAGEDLLM_CPU_INT8_ROW_STREAM=1/0, its non-temporal prefetch (on from AMD Zen 5).
    for name, op in (
        ("PAGEDLLM_CPU_INT8_ROW_WORDS", torch.ops.pagedllm.cpu_int8_row_words),
        ("PAGEDLLM_CPU_INT8_ROW_STREAM", torch.ops.pagedllm.cpu_int8_row_stream),
    ):
        if os.environ.get(name):
            op(env_flag(name, False))
    _register_fake_gemm()
    return torch.ops.pagedllm
