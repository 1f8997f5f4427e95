"""pagedllm's native operators: a C++ PyTorch extension for the CPU (how it is built and
found: below), and Triton kernels for CUDA (`ops/triton/`, one kernel a file).

`cpu_ops()` returns the `torch.ops.pagedllm` namespace, or None when the fast path is off
(`PAGEDLLM_CPU_KERNELS=0`) or cannot be had (no C++ compiler or ninja, a failed build): every
caller then keeps its pure-PyTorch code, which stays the reference the kernels are tested
against. See `pagedllm/ops/build.py` for where the build lives.
"""

from pagedllm.ops.build import cpu_ops, kernels_enabled

__all__ = ["cpu_ops", "kernels_enabled"]
