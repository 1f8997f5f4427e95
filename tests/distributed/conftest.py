"""Helper processes of the distributed tests start the way the executor starts its workers
(from the fork server, which imported torch once), so each costs a fork, not an import."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def worker_mp_context():
    from pagedllm.executor.multiproc_executor import worker_mp_context

    return worker_mp_context()
