"""The real demo model (SmolLM2-135M-Instruct, testing/smollm2.py) for the tests: converted
once into the repository's `.demo-model/` (where `make test` puts it first), and one fp32
engine on it shared by the session."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_ROOT = REPO_ROOT / ".demo-model"
MAX_MODEL_LEN = 1024
PARIS_QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from pagedllm.testing.smollm2 import fetch_demo_model

    return str(fetch_demo_model(DEMO_ROOT))


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> str:
    from pagedllm.testing.smollm2 import demo_gguf_path

    return str(demo_gguf_path(DEMO_ROOT))


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    """fp32 (the greedy oracle's dtype), engine core in-process."""
    from pagedllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            model=smollm2_dir,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            kv_cache_memory_bytes=64 << 20,
            seed=0,
        )
    yield llm
    llm.shutdown()
