"""Where the Triton kernel tests run: in Triton's interpreter on CPU tensors (no GPU: the
root conftest sets TRITON_INTERPRET=1), compiled on CUDA tensors when a GPU is present (those
cases are marked `gpu`). The other device's cases are skipped."""

from __future__ import annotations

import pytest

from pagedllm.ops.triton import triton_usable

TRITON_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not triton_usable("cpu"), reason="Triton's interpreter is off (TRITON_INTERPRET)"
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not triton_usable("cuda"), reason="needs a CUDA device"),
        ],
    ),
]
