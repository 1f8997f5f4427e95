"""KV connectors: the seam through which KV blocks leave or enter this engine (vLLM V1's API).

One connector class serves two roles, built separately:

* scheduler side (in the engine core, beside the `Scheduler`; never touches tensors):
  `get_num_new_matched_tokens` says how many tokens beyond the local prefix-cache hit the
  connector can supply and whether that load is asynchronous; `update_state_after_alloc`
  learns which blocks were allocated for a request; `build_connector_meta` describes one
  step's loads and saves as plain data, carried to the worker in `SchedulerOutput`;
  `request_finished` says whether a finished request's blocks must stay allocated until a
  transfer ends (and what to hand back to the client, `kv_transfer_params`);
  `update_connector_output` sees what the worker reported.
* worker side (one per `Worker`, beside its KV-cache tensors): `start_load_kv` before the
  forward, `wait_for_layer_load` / `save_kv_layer` around each attention layer (so a
  transfer can overlap the layers before it), `wait_for_save` after the forward, and
  `get_finished` reports the asynchronous transfers that ended.

Loads come in two kinds. Synchronous: the tokens are scheduled in the same step and the worker
has them in place before the layer that reads them. Asynchronous: the request waits in
`WAITING_FOR_REMOTE_KVS` while other requests run; its blocks are not prefix-cached until the
worker lists it in `finished_recving`; a failed load lists its blocks in `invalid_block_ids`
and the request is computed locally instead (the failure policy: recompute, never serve KV
that did not arrive). A request finished while its load is in flight keeps its blocks until
the load ends, so no transfer ever writes into a block someone else was given.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheBlocks
    from pagedllm.core.request import Request
    from pagedllm.core.sched.output import SchedulerOutput
    from pagedllm.outputs import KVConnectorOutput, ModelRunnerOutput
    from pagedllm.sampling_params import SamplingParams


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B024 (a marker base: each connector defines its fields)
    """One step's instructions from the scheduler side to the worker side: plain, picklable
    data (it crosses to worker processes inside `SchedulerOutput`)."""


def kv_transfer_params_of(params: SamplingParams) -> dict[str, Any] | None:
    """The request's `kv_transfer_params` (vLLM carries them in `SamplingParams.extra_args`)."""
    extra = params.extra_args
    return extra.get("kv_transfer_params") if extra else None


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    """Base of every connector; see the module docstring for the two roles' contracts.

    Subclasses implement the abstract methods of their roles; a method of the other role is
    never called on an instance. Worker-side methods run in the model runner's thread,
    except where a connector documents its own background threads.
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        assert config.kv_transfer_config is not None
        self.config = config
        self.role = role
        self.kv_transfer_config: KVTransferConfig = config.kv_transfer_config
        self.block_size = config.cache_config.block_size
        self._connector_metadata: KVConnectorMetadata | None = None

    # ---- validation (front end) -------------------------------------------------------------

    @classmethod
    def validate_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        """Raise ValueError for options this connector cannot honour. Default: it takes no
        `kv_connector_extra_config` keys."""
        check_extra_config(kv_transfer_config, cls.__name__, {})

    @classmethod
    def prepare_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        """Resolve what both roles must agree on before either is built (e.g. a free port
        for `kv_port=0`). Called once per engine, in its process."""
        return None

    @classmethod
    def validate_kv_transfer_params(
        cls, params: SamplingParams, kv_transfer_config: KVTransferConfig
    ) -> None:
        """Raise ValueError if a request's `kv_transfer_params` are not for this connector.
        Default: the connector takes none."""
        if kv_transfer_params_of(params) is not None:
            raise ValueError(
                f"kv_transfer_params are not used by the {cls.__name__}; remove them (they "
                "are for a prefill/decode connector such as the P2pZmqConnector)"
            )

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_dim: int,
        kv_scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        """The worker's KV-cache tensors by attention-layer name; `block_dim` is the axis that
        indexes blocks in each of them; `kv_scales` an fp8 cache's (k_scale, v_scale) by layer
        (None: all 1.0). Called once, before the first step."""
        return None

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound this step"
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin this step's loads (before the forward). Synchronous loads must be complete
        for layer L when `wait_for_layer_load(L)` returns; asynchronous ones report through
        `get_finished`."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's synchronous loads into `layer_name` are in place."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Called after attention layer `layer_name` wrote this step's K/V into `kv_layer`."""
        return None

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer read the KV cache (after the forward): the
        scheduler may reuse the saved blocks from the next step on."""
        return None

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Asynchronous transfers that ended since the last call. `finished_req_ids`: the
        requests the scheduler finished since the last step."""
        from pagedllm.outputs import KVConnectorOutput

        return KVConnectorOutput()

    def shutdown(self) -> None:
        """Stop background threads and sockets (idempotent)."""
        return None

    # ---- scheduler side ---------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens the connector can supply beyond the first `num_computed_tokens`, whether
        the load is asynchronous). Never more than `request.num_tokens - 1 -
        num_computed_tokens`: the last token is always computed, for its logits. Must not
        change any state: the scheduler may ask again if the request cannot be admitted."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The request was admitted: `blocks` are all its blocks now, its local prefix-cache
        hit (`request.num_computed_tokens` tokens, during this call) first; the next
        `num_external_tokens` are the connector's to load. Called for every admitted
        request, with 0 when the connector supplies nothing."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side; resets the step's pending state.
        `scheduler_output` holds each request's computed tokens before the step."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the worker side reported this step (called before the scheduler acts on it)."""
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished (stopped, length-capped or aborted). Returns (keep its blocks
        until the worker lists it in finished_sending / finished_recving, kv_transfer_params
        to return to the client)."""
        return False, None

    def has_pending_transfers(self) -> bool:
        """Whether the worker side may still report something (held blocks, loads in flight):
        the engine keeps stepping while this is true."""
        return False


def check_extra_config(
    kv_transfer_config: KVTransferConfig, connector: str, allowed: dict[str, type | tuple]
) -> None:
    """ValueError for a `kv_connector_extra_config` key that `connector` does not take or a
    value of the wrong type (`allowed`: key -> type(s))."""
    for key, value in kv_transfer_config.kv_connector_extra_config.items():
        if key not in allowed:
            raise ValueError(
                f"kv_connector_extra_config key {key!r} is not used by the {connector}; "
                f"valid keys are {sorted(allowed)}"
            )
        types = allowed[key] if isinstance(allowed[key], tuple) else (allowed[key],)
        # bool is an int to isinstance, never to a user.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(
                f"kv_connector_extra_config[{key!r}]={value!r} must be a {names} for the "
                f"{connector}"
            )


def track_scheduled_blocks(
    scheduler_output: SchedulerOutput, block_ids: dict[str, list[int]]
) -> dict[str, int]:
    """Keep `block_ids` (request id -> all its blocks) current with this step's allocations;
    returns each scheduled request's computed tokens before the step."""
    starts = {}
    for new in scheduler_output.scheduled_new_reqs:
        block_ids[new.req_id] = list(new.block_ids)
        starts[new.req_id] = new.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_ids, start in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
    ):
        block_ids[req_id].extend(new_ids)
        starts[req_id] = start
    return starts


def execute_with_kv_connector(
    connector: KVConnectorBase_V1,
    scheduler_output: SchedulerOutput,
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
) -> ModelRunnerOutput:
    """One model-runner step wrapped in the worker side's step protocol: bind the metadata,
    start loads, run `execute`, wait for saves, report finished transfers. Runs on empty
    steps too (a step may carry only transfers)."""
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)  # type: ignore[arg-type]
    try:
        connector.start_load_kv()
        output = execute(scheduler_output)
        connector.wait_for_save()
    finally:
        connector.clear_connector_metadata()
    output.kv_connector_output = connector.get_finished(scheduler_output.finished_req_ids)
    return output
