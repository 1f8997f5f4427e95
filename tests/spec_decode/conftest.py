"""Fixtures for the speculative-decoding tests: the tiny target, a different tiny draft model,
random EAGLE and Medusa heads for it, and the engine core run in-process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def _engine_core_in_process():
    """In-process EngineCore: fast start, and the scheduler is reachable for assertions."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="session")
def target_dir(tiny_llama_dir) -> str:
    return tiny_llama_dir


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory) -> str:
    """A different random checkpoint with the target's vocabulary (one layer, other seed)."""
    from pagedllm.testing import make_demo_model

    return make_demo_model(
        tmp_path_factory.mktemp("tiny-draft"), preset="tiny", seed=1, num_hidden_layers=1
    )


@pytest.fixture(scope="session")
def eagle_dir(tmp_path_factory, target_dir) -> str:
    from pagedllm.spec_decode.testing import make_eagle_head

    return make_eagle_head(tmp_path_factory.mktemp("tiny-eagle"), target_dir, seed=3)


@pytest.fixture(scope="session")
def medusa_dir(tmp_path_factory, target_dir) -> str:
    from pagedllm.spec_decode.testing import make_medusa_heads

    return make_medusa_heads(tmp_path_factory.mktemp("tiny-medusa"), target_dir, num_heads=3)


@pytest.fixture(scope="session")
def spec_configs(target_dir, draft_dir, eagle_dir, medusa_dir) -> dict[str, dict]:
    """Method name -> speculative_config for `LLM(...)` (k = 3 each)."""
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 4},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": draft_dir},
        "draft_is_target": {
            "method": "draft_model", "num_speculative_tokens": 3, "model": target_dir
        },
        "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": eagle_dir},
        "medusa": {"method": "medusa", "num_speculative_tokens": 3, "model": medusa_dir},
    }  # fmt: skip
