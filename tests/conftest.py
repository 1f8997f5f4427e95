"""Session-wide fixtures: tiny seeded checkpoints (built once per session, lazily) and an
`EngineConfig` factory for loading them without the engine front end."""

from __future__ import annotations

import os

# Tests run tiny models, whose kernels are far smaller than the cost of waking a second
# OpenMP thread: one thread is several times faster, and steadier on a busy 2-core machine.
# Set before torch is imported; engine and server processes the tests spawn inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.testing.demo_model import TINY_ARCH_OVERRIDES

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; the variable must
# be set before a kernel module is imported (kernels are defined interpreted or compiled then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.x) multiplies bf16 `tl.dot` operands as their raw uint16 bit
    patterns (numpy has no bf16); widen them to fp32 first, as it already does for fp8, so the
    kernels' bf16 path is checked like the GPU computes it (bf16 products, fp32 sums)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_pagedllm_bf16_dot", False):
        return
    create_dot = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view("float32"), tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot_bf16
    builder._pagedllm_bf16_dot = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_bf16_dot()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Arch key of TINY_ARCH_OVERRIDES ("llama", "mistral", "qwen2", "qwen3") -> fp32 "tiny"
    checkpoint dir, built on first access."""
    from pagedllm.testing import make_demo_model

    class _LazyDirs(dict):
        def __missing__(self, arch: str) -> str:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            self[arch] = make_demo_model(path, preset="tiny", seed=0, **TINY_ARCH_OVERRIDES[arch])
            return self[arch]

    return _LazyDirs()


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def make_engine_config():
    """Factory: (model_dir, dtype=torch.float32, max_model_len=None) -> EngineConfig on CPU."""
    from pagedllm.engine.arg_utils import EngineArgs

    def make(
        model_dir: str, dtype: torch.dtype = torch.float32, max_model_len: int | None = None
    ) -> EngineConfig:
        config = EngineArgs(
            model=model_dir, dtype=dtype, max_model_len=max_model_len, max_num_seqs=8, device="cpu"
        ).create_engine_config()
        # One step holds a whole max-length prompt, as the model tests expect.
        config.scheduler_config.max_num_batched_tokens = config.model_config.max_model_len
        return config

    return make


@pytest.fixture(scope="session")
def copy_model_dir(tmp_path_factory) -> str:
    """The tiny preset trained (seeded, ~25 s of CPU) to continue repeated text: a model whose
    greedy choices are decided, not rounding noise (copy loss ~0.3 nats/token)."""
    from pagedllm.testing.copy_model import train_copy_model

    path, _ = train_copy_model(
        tmp_path_factory.mktemp("copy-tiny"), preset="tiny", steps=1200, seq_len=64
    )
    return path
