"""Every Triton kernel compiles to an H100 binary (sm_90 cubin) on this GPU-less machine: the
compiled path's type rules, layouts and register allocation are checked, not just the
interpreter's semantics."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm.ops.triton import HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops.triton.aot_compile", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    names = {line.split()[1] for line in lines}
    assert names == {
        "_unified_attention_kernel",
        "_reshape_and_cache_kernel",
        "_top_k_top_p_kernel",
        "_accept_recover_kernel",
    }
    assert len(lines) == 13 and all("bytes of cubin" in line for line in lines)
