"""The structured-output tests run the EngineCore in-process, so they can look at the
scheduler (the server test covers the msgpack process boundary), on one torch thread: the
tiny model's kernels are microseconds long, and on a shared 2-core machine a second thread
makes each one wait for a busy core."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _engine_core_in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
