"""Every Triton kernel compiles to an H100 binary (sm_90 cubin) on this GPU-less machine: the
compiled path's type rules, layouts and register allocation are checked, not just the
interpreter's semantics. The fp8-cache variants compile for an A100 (sm_80) too: they need no
fp8 instructions (ops/triton/fp8.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm.ops.triton import HAS_TRITON


def _compile(tmp_path, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops.triton.aot_compile", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_compiles_for_sm90(tmp_path):
    lines = _compile(tmp_path, "90")
    names = {line.split()[1] for line in lines}
    assert names == {
        "_unified_attention_kernel",
        "_reshape_and_cache_kernel",
        "_top_k_top_p_kernel",
        "_accept_recover_kernel",
    }
    assert len(lines) == 19 and all("bytes of cubin" in line for line in lines)
    assert sum("('FP8', 1)" in line or "('FP8', 2)" in line for line in lines) == 6


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fp8_cache_kernels_compile_for_sm80(tmp_path):
    lines = _compile(tmp_path, "80", "fp8")
    assert len(lines) == 6 and all(
        line.startswith("sm_80 ") and "bytes of cubin" in line for line in lines
    )
