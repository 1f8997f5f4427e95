"""The scheduler's side of a KV connector: which requests wait for KV, which blocks are held.

Three things the plain scheduler never has to know, kept here so `scheduler.py` only calls in
at a few points:

* asynchronous loads: an admitted request whose KV the connector loads in the background is
  parked in WAITING_FOR_REMOTE_KVS, holding its blocks (not yet prefix-cached); when the
  worker lists it in `finished_recving` it becomes WAITING with the loaded tokens computed,
  or, if any of its blocks is in `invalid_block_ids`, with its blocks freed and no further
  external load: it is computed locally (the recompute failure policy);
* held blocks: a finished request whose blocks a transfer still reads (a prefill waiting for
  its decode instance to pull them) or writes (a load in flight when the request was
  aborted) keeps them until the worker reports that transfer finished;
* the connector's scheduler-side calls, in the order its contract states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.sched.output import SchedulerOutput
    from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1
    from pagedllm.outputs import KVConnectorOutput


class KVTransferTracker:
    """Invariants between steps: `loading` holds exactly the parked (WAITING_FOR_REMOTE_KVS)
    requests plus finished ones still held for their load; every key of `held` is a
    finished request that is no longer in the scheduler's request map but still holds its
    blocks in the KV-cache manager."""

    def __init__(self, connector: KVConnectorBase_V1, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.held: dict[str, Request] = {}
        # Asynchronous loads in flight: request id -> tokens they bring beyond the local hit.
        self.loading: dict[str, int] = {}
        # Loads the worker reported since: request id -> whether every block arrived.
        self.loaded: dict[str, bool] = {}
        # Requests whose load failed: never offered external tokens again.
        self.failed: set[str] = set()

    # ---- admission ----------------------------------------------------------------------------

    def get_external_tokens(self, request: Request, num_hit_tokens: int) -> tuple[int, bool]:
        """(tokens the connector supplies beyond the local hit, whether asynchronously).
        None for prompt-logprobs requests (they need every position's logits) and for
        requests whose load failed before."""
        if request.sampling_params.prompt_logprobs is not None or request.request_id in self.failed:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(
            request, num_hit_tokens
        )
        assert 0 <= num_external <= request.num_tokens - 1 - num_hit_tokens, (
            f"{type(self.connector).__name__} offered {num_external} tokens for request "
            f"{request.request_id} ({request.num_tokens} tokens, {num_hit_tokens} hit locally)"
        )
        return num_external, load_async and num_external > 0

    def after_alloc(self, request: Request, num_external: int, load_async: bool) -> None:
        """The request got its blocks; an asynchronous load parks it (the caller keeps it in
        the waiting queue)."""
        blocks = KVCacheBlocks(list(self.kv_cache_manager.req_to_blocks[request.request_id]))
        self.connector.update_state_after_alloc(request, blocks, num_external)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.loading[request.request_id] = num_external

    def finish_load(self, request: Request) -> bool:
        """Whether a parked request's load has ended; it is then WAITING again, with the
        loaded tokens computed (success) or with no blocks and nothing computed (failure)."""
        ok = self.loaded.pop(request.request_id, None)
        if ok is None:
            return False
        num_external = self.loading.pop(request.request_id)
        request.status = RequestStatus.WAITING
        if ok:
            request.num_computed_tokens += num_external
        else:
            self.failed.add(request.request_id)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
        return True

    def release_waiting_holder(self, waiting: list[Request], keep: Request) -> bool:
        """Free the blocks of the last waiting request other than `keep` whose load has ended,
        so that `keep` (ahead of it) can be admitted: without this, requests holding loaded
        KV behind a head that needs their blocks would wait for each other forever. The
        victim starts over (its connector may load it again). False if there is none."""
        for request in reversed(waiting):
            if request is keep:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.request_id not in self.loaded:
                    continue  # its load still writes into its blocks
                self.finish_load(request)
            if request.request_id in self.kv_cache_manager.req_to_blocks:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                return True
        return False

    # ---- steps --------------------------------------------------------------------------------

    def build_meta(self, scheduler_output: SchedulerOutput) -> None:
        scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
            scheduler_output
        )

    def update_from_output(self, output: KVConnectorOutput) -> None:
        """Fold in what the worker finished: loads end, held blocks are freed."""
        self.connector.update_connector_output(output)
        invalid = output.invalid_block_ids
        for req_id in output.finished_recving:
            if req_id in self.held:
                self.loading.pop(req_id, None)
                self._release(req_id)
            elif req_id in self.loading:
                block_ids = self.kv_cache_manager.get_block_ids(req_id)
                self.loaded[req_id] = not invalid or invalid.isdisjoint(block_ids)
        for req_id in output.finished_sending:
            self._release(req_id)

    def _release(self, req_id: str) -> None:
        request = self.held.pop(req_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    # ---- finished requests --------------------------------------------------------------------

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """(whether the request's blocks stay held, the connector's kv_transfer_params). A
        request whose load is in flight is held until the load ends, whatever the connector
        says, so the load never writes into blocks given to someone else."""
        req_id = request.request_id
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        delay, params = self.connector.request_finished(request, block_ids)
        load_in_flight = req_id in self.loading and req_id not in self.loaded
        self.loaded.pop(req_id, None)
        self.failed.discard(req_id)
        if (delay or load_in_flight) and block_ids:
            self.held[req_id] = request
            return True, params
        self.loading.pop(req_id, None)
        return False, params

    def has_pending(self) -> bool:
        """Whether the worker may still report something: the engine keeps stepping."""
        return bool(self.held or self.loading) or self.connector.has_pending_transfers()

    def block_holders(self, waiting: list[Request]) -> set[str]:
        """Ids of the non-running requests that hold blocks (for integrity checks)."""
        parked = {
            r.request_id
            for r in waiting
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.num_computed_tokens > 0
        }
        return parked | set(self.held)
