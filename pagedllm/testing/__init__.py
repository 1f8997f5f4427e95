"""Helpers for tests and benchmarks: seeded random-weight checkpoints built offline."""

from pagedllm.testing.demo_model import (
    PRESETS,
    TINY_ARCH_OVERRIDES,
    build_tokenizer,
    make_demo_model,
)

__all__ = ["PRESETS", "TINY_ARCH_OVERRIDES", "build_tokenizer", "make_demo_model"]
