"""The structured-output tests run the EngineCore in-process, so they can look at the
scheduler (the server test covers the msgpack process boundary)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def _engine_core_in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield
