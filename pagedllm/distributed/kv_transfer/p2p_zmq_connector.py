"""`P2pZmqConnector`: disaggregated prefill/decode; the decode engine pulls the prefill
engine's KV blocks over TCP (ZMQ), with vLLM NixlConnector's `kv_transfer_params`.

The dance (a proxy such as `pagedllm disagg-proxy` drives it):
1. The prefill engine (kv_producer / kv_both) gets the request with `max_tokens=1` and
   `kv_transfer_params={"do_remote_decode": true}`. When it finishes, `request_finished`
   keeps its prompt blocks allocated and returns `{"do_remote_prefill": true,
   "remote_engine_id", "remote_host", "remote_port", "remote_block_ids",
   "remote_request_id"}`, which the server puts in its response. Its worker registers the
   blocks with a `KVSender` (zmq_transfer.py) on the next step.
2. The decode engine (kv_consumer / kv_both) gets the same prompt with those params.
   `get_num_new_matched_tokens` offers every prompt token but the last beyond its own
   prefix-cache hit, loaded asynchronously: the request waits in WAITING_FOR_REMOTE_KVS
   while its worker pulls the matching remote blocks layer by layer. Once they are in, the
   last prompt token is computed (for its logits) and decoding goes on as usual.
3. The pull (or, when the decode engine needs none of the blocks, an empty pull) tells the
   sender to release the blocks; blocks nobody pulls are freed after `abort_request_timeout`
   seconds (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 by default).

Held blocks count against the prefill engine's KV cache until they are pulled or expire, so
a prefill engine whose decode side stops pulling runs out of blocks for new requests.

Failures: a pull that is refused, times out (`transfer_timeout`, 60 s), or loses its peer
(noticed at once: a refused or dropped connection) marks the request's blocks invalid and the
decode engine computes the whole prompt itself. `do_remote_prefill` is cleared once tried, so
a failed or preempted request is never pulled twice.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from pagedllm.distributed.kv_transfer.background import BackgroundTransfers
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    check_extra_config,
    kv_transfer_params_of,
)
from pagedllm.distributed.kv_transfer.kv_blocks import PagedKVBlocks
from pagedllm.distributed.kv_transfer.zmq_transfer import KVSender, pull_kv_blocks
from pagedllm.engine import FinishReason
from pagedllm.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheBlocks
    from pagedllm.core.request import Request
    from pagedllm.core.sched.output import SchedulerOutput
    from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0
DEFAULT_TRANSFER_TIMEOUT_S = 60.0
# The fields a decode request's kv_transfer_params carry, and their types.
_REMOTE_PREFILL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_block_ids": list,
    "remote_request_id": str,
}


@dataclass
class RemotePull:
    """Pull `remote_block_ids` of `remote_request_id` from host:port into `block_ids`
    (empty: only release them). `req_id` None: a release no local request waits for."""

    req_id: str | None
    host: str
    port: int
    engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass
class P2pZmqMetadata(KVConnectorMetadata):
    pulls: list[RemotePull] = field(default_factory=list)
    # Finished prefills whose blocks to serve: request id -> block ids.
    sends: dict[str, list[int]] = field(default_factory=dict)


def _pick_free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class P2pZmqConnector(KVConnectorBase_V1):
    """See the module docstring. Extra config: `abort_request_timeout` (s, prefill side),
    `transfer_timeout` (s, decode side)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        cfg = self.kv_transfer_config
        extra = cfg.kv_connector_extra_config
        self.abort_request_timeout = float(
            extra.get("abort_request_timeout", DEFAULT_ABORT_REQUEST_TIMEOUT_S)
        )
        self.transfer_timeout = float(extra.get("transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S))
        # Scheduler side: this step's pulls and sends.
        self._pulls: list[RemotePull] = []
        self._sends: dict[str, list[int]] = {}
        # Worker side.
        self._sender: KVSender | None = None
        self._kv: PagedKVBlocks | None = None
        self._transfers: BackgroundTransfers | None = None
        self._zmq_ctx: zmq.Context | None = None
        if role == KVConnectorRole.WORKER:
            self._transfers = BackgroundTransfers("kv-pull")
            self._zmq_ctx = zmq.Context()

    @classmethod
    def validate_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        allowed = {"abort_request_timeout": (int, float), "transfer_timeout": (int, float)}
        check_extra_config(kv_transfer_config, cls.__name__, allowed)
        for key, value in kv_transfer_config.kv_connector_extra_config.items():
            if value <= 0:
                raise ValueError(f"kv_connector_extra_config[{key!r}]={value} must be > 0")

    @classmethod
    def prepare_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        if kv_transfer_config.kv_port == 0 and kv_transfer_config.is_kv_producer:
            kv_transfer_config.kv_port = _pick_free_port(kv_transfer_config.kv_ip)

    @classmethod
    def validate_kv_transfer_params(
        cls, params: SamplingParams, kv_transfer_config: KVTransferConfig
    ) -> None:
        kv_params = kv_transfer_params_of(params)
        if kv_params is None:
            return
        known = {"do_remote_prefill", "do_remote_decode", *_REMOTE_PREFILL_FIELDS, "tp_size"}
        unknown = sorted(set(kv_params) - known)
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown key(s) {unknown}")
        if kv_params.get("do_remote_decode") and not kv_transfer_config.is_kv_producer:
            raise ValueError(
                f"kv_transfer_params.do_remote_decode needs kv_role kv_producer or kv_both, "
                f"this engine is {kv_transfer_config.kv_role}"
            )
        if not kv_params.get("do_remote_prefill"):
            return
        if not kv_transfer_config.is_kv_consumer:
            raise ValueError(
                f"kv_transfer_params.do_remote_prefill needs kv_role kv_consumer or kv_both, "
                f"this engine is {kv_transfer_config.kv_role}"
            )
        if params.n > 1:
            raise ValueError(
                "kv_transfer_params.do_remote_prefill with n > 1 is not supported: the remote "
                "blocks can be pulled once"
            )
        for name, types in _REMOTE_PREFILL_FIELDS.items():
            if not isinstance(kv_params.get(name), types):
                raise ValueError(
                    f"kv_transfer_params.{name}={kv_params.get(name)!r} is missing or of the "
                    "wrong type"
                )
        if not all(isinstance(b, int) for b in kv_params["remote_block_ids"]):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids")

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        # Every prompt token but the last: that one is computed here, for its logits.
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if count <= 0:
            return 0, False
        num_blocks_needed = -(-(request.num_prompt_tokens - 1) // self.block_size)
        if len(params["remote_block_ids"]) < num_blocks_needed:
            logger.warning(
                "request %s: kv_transfer_params hold too few remote blocks for its prompt; "
                "computing it locally",
                request.request_id,
            )
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # pulled at most once, even if preempted later
        first = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        remote = list(params["remote_block_ids"])
        if num_external_tokens == 0:
            first = end = 0  # nothing to pull: only tell the sender to release its blocks
        assert end <= len(remote), "get_num_new_matched_tokens checked the remote blocks"
        self._pulls.append(
            RemotePull(
                req_id=request.request_id if end > first else None,
                host=params["remote_host"],
                port=params["remote_port"],
                engine_id=params["remote_engine_id"],
                remote_request_id=params["remote_request_id"],
                remote_block_ids=remote[first:end],
                block_ids=blocks.get_block_ids()[first:end],
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pZmqMetadata:
        meta = P2pZmqMetadata(pulls=self._pulls, sends=self._sends)
        self._pulls, self._sends = [], {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        reason = request.get_finished_reason()
        if not params or not params.get("do_remote_decode") or reason in (None, FinishReason.ABORT):
            return False, None
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        send_ids = block_ids[:num_prompt_blocks]
        self._sends[request.request_id] = send_ids
        cfg = self.kv_transfer_config
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": cfg.engine_id,
            "remote_host": cfg.kv_ip,
            "remote_port": cfg.kv_port,
            "remote_block_ids": send_ids,
            "remote_request_id": request.request_id,
        }

    def has_pending_transfers(self) -> bool:
        return bool(self._pulls or self._sends)

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_dim: int,
        kv_scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        self._kv = PagedKVBlocks(kv_caches, block_dim, kv_scales)
        cfg = self.kv_transfer_config
        if cfg.is_kv_producer:
            self._sender = KVSender(
                self._kv, cfg.engine_id, cfg.kv_ip, cfg.kv_port, self.abort_request_timeout
            )

    def start_load_kv(self) -> None:
        meta: P2pZmqMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        if meta.sends:
            assert self._sender is not None, "do_remote_decode on an engine that is no producer"
            for req_id, block_ids in meta.sends.items():
                self._sender.register(req_id, block_ids)
        assert self._transfers is not None
        for pull in meta.pulls:
            self._transfers.submit(pull.req_id, pull.block_ids, lambda p=pull: self._pull(p))

    def _pull(self, pull: RemotePull) -> None:
        assert self._kv is not None and self._zmq_ctx is not None
        request = {
            "engine_id": pull.engine_id,
            "request_id": pull.remote_request_id,
            "block_ids": pull.remote_block_ids,
        }
        pull_kv_blocks(
            self._zmq_ctx,
            self._kv,
            pull.host,
            pull.port,
            request,
            pull.block_ids,
            self.transfer_timeout,
        )

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        assert self._transfers is not None
        output = self._transfers.take_finished()
        if self._sender is not None:
            output.finished_sending = self._sender.take_released()
        return output

    def shutdown(self) -> None:
        if self._transfers is not None:
            self._transfers.shutdown()
            self._transfers = None
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
        if self._zmq_ctx is not None:
            self._zmq_ctx.term()
            self._zmq_ctx = None
