"""`BackgroundTransfers`: a connector's asynchronous loads, run off the model's thread.

Each load is a job for one request: a callable that writes the request's blocks (network pull,
file read) and raises if it cannot. Jobs run on a small thread pool while the engine keeps
stepping; `take_finished` hands the ended ones to `get_finished`: every ended request in
`finished_recving`, and the blocks of a failed one in `invalid_block_ids` (the scheduler then
computes that request locally). A job's blocks belong to no running request until it ends, so
writing them from another thread is safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pagedllm.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)


class BackgroundTransfers:
    """Thread-safe. `shutdown` waits for no job: a load still running at shutdown writes into
    a cache no one reads any more."""

    def __init__(self, name: str, max_workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._invalid: set[int] = set()
        self._num_running = 0

    def submit(self, req_id: str | None, block_ids: list[int], job: Callable[[], None]) -> None:
        """Run `job` for request `req_id` (None: a job no request waits for, e.g. a notice
        to a peer; its failure is only logged)."""
        with self._lock:
            self._num_running += 1
        future = self._pool.submit(job)
        future.add_done_callback(lambda f: self._on_done(f, req_id, block_ids))

    def _on_done(self, future: Future, req_id: str | None, block_ids: list[int]) -> None:
        error = future.exception()
        if error is not None:
            logger.warning(
                "KV transfer for request %s failed (%s: %s); it will be recomputed",
                req_id,
                type(error).__name__,
                error,
            )
        with self._lock:
            self._num_running -= 1
            if req_id is None:
                return
            self._finished.add(req_id)
            if error is not None:
                self._invalid.update(block_ids)

    def take_finished(self) -> KVConnectorOutput:
        """The requests whose job ended since the last call (`finished_recving`) and the
        blocks of the failed ones (`invalid_block_ids`)."""
        with self._lock:
            finished, self._finished = self._finished, set()
            invalid, self._invalid = self._invalid, set()
        return KVConnectorOutput(finished_recving=finished, invalid_block_ids=invalid)

    @property
    def num_running(self) -> int:
        with self._lock:
            return self._num_running

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
