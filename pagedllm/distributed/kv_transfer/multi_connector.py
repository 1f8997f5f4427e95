"""`MultiConnector`: several connectors chained (vLLM's), e.g. P2P transfer plus offloading.

`kv_connector_extra_config = {"connectors": [{"kv_connector": NAME, ...}, ...]}`: each entry
is a KV transfer config of its own; keys it leaves out (kv_role, engine_id, kv_ip, kv_port)
come from the outer config.

Loads: the first connector, in order, that offers tokens for a request loads them all; the
others see the request with nothing to load. Saves: every connector saves. A finished
request's blocks stay held while any connector holds them; the worker side reports it in
`finished_sending` once every connector that held it has (the scheduler side tells it how
many in the metadata). `kv_transfer_params` of a request go to every connector and the first
one a connector returns goes back to the client.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    kv_transfer_params_of,
)
from pagedllm.outputs import KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheBlocks
    from pagedllm.core.request import Request
    from pagedllm.core.sched.output import SchedulerOutput
    from pagedllm.sampling_params import SamplingParams

_INHERITED = ("kv_role", "engine_id", "kv_ip", "kv_port", "kv_load_failure_policy")


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: tuple[KVConnectorMetadata, ...] = ()
    # Finished requests held by several connectors: how many must report them sent.
    num_senders: dict[str, int] = field(default_factory=dict)


def child_configs(kv_transfer_config: KVTransferConfig) -> list[KVTransferConfig]:
    """The chained connectors' configs (ValueError if malformed)."""
    from pagedllm.config import KVTransferConfig

    extra = kv_transfer_config.kv_connector_extra_config
    unknown = sorted(set(extra) - {"connectors"})
    if unknown:
        raise ValueError(f"the MultiConnector takes only 'connectors', not {unknown}")
    entries = extra.get("connectors")
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            "the MultiConnector needs kv_connector_extra_config.connectors: a non-empty list of "
            "KV transfer configs"
        )
    configs = []
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("kv_connector") == "MultiConnector":
            raise ValueError(f"bad MultiConnector entry {entry!r}")
        inherited = {k: getattr(kv_transfer_config, k) for k in _INHERITED if k not in entry}
        configs.append(KVTransferConfig.from_dict({**inherited, **entry}))
    return configs


class MultiConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        super().__init__(config, role)
        self.connectors: list[KVConnectorBase_V1] = []
        for child in child_configs(self.kv_transfer_config):
            child_config = dataclasses.replace(config, kv_transfer_config=child)
            self.connectors.append(KVConnectorFactory.create_connector(child_config, role))
        # Scheduler side: which connector loads each request; held-by counts to send.
        self._loader: dict[str, int] = {}
        self._num_senders: dict[str, int] = {}
        # Worker side: how many connectors still have to report a request sent.
        self._sends_left: Counter[str] = Counter()
        self._sent_early: Counter[str] = Counter()

    @classmethod
    def validate_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        for child in child_configs(kv_transfer_config):
            KVConnectorFactory.validate(child)

    @classmethod
    def prepare_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        # A child without a kv_port of its own inherits the outer one: resolve it there;
        # one with its own gets it resolved in its entry (both roles read these configs).
        entries = kv_transfer_config.kv_connector_extra_config["connectors"]
        for entry, child in zip(entries, child_configs(kv_transfer_config)):
            KVConnectorFactory.get_connector_class(child).prepare_config(child)
            if "kv_port" in entry:
                entry["kv_port"] = child.kv_port
            else:
                kv_transfer_config.kv_port = child.kv_port

    @classmethod
    def validate_kv_transfer_params(
        cls, params: SamplingParams, kv_transfer_config: KVTransferConfig
    ) -> None:
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        if kv_transfer_params_of(params) is None:
            return
        errors = []
        for child in child_configs(kv_transfer_config):
            try:
                KVConnectorFactory.get_connector_class(child).validate_kv_transfer_params(
                    params, child
                )
                return  # one connector that takes them is enough
            except ValueError as e:
                errors.append(str(e))
        raise ValueError("; ".join(errors))

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        for i, connector in enumerate(self.connectors):
            num_tokens, load_async = connector.get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            if num_tokens > 0:
                self._loader[request.request_id] = i
                return num_tokens, load_async
        self._loader.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        loader = self._loader.pop(request.request_id, None) if num_external_tokens else None
        for i, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(
                request, blocks, num_external_tokens if i == loader else 0
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        metadata = tuple(c.build_connector_meta(scheduler_output) for c in self.connectors)
        num_senders, self._num_senders = self._num_senders, {}
        return MultiKVConnectorMetadata(metadata, num_senders)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for connector in self.connectors:
            connector.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        num_holding, kv_transfer_params = 0, None
        for connector in self.connectors:
            delay, params = connector.request_finished(request, block_ids)
            num_holding += int(delay)
            if kv_transfer_params is None:
                kv_transfer_params = params
        if num_holding > 1:
            self._num_senders[request.request_id] = num_holding
        return num_holding > 0, kv_transfer_params

    def has_pending_transfers(self) -> bool:
        return bool(self._num_senders) or any(c.has_pending_transfers() for c in self.connectors)

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_dim: int,
        kv_scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches, block_dim, kv_scales)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        super().bind_connector_metadata(metadata)
        assert isinstance(metadata, MultiKVConnectorMetadata)
        for connector, child in zip(self.connectors, metadata.metadata):
            connector.bind_connector_metadata(child)
        for req_id, count in metadata.num_senders.items():
            self._sends_left[req_id] += count

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for connector in self.connectors:
            connector.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for connector in self.connectors:
            connector.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        for connector in self.connectors:
            connector.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        for connector in self.connectors:
            connector.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for connector in self.connectors:
            child = connector.get_finished(finished_req_ids)
            out.finished_recving |= child.finished_recving
            out.invalid_block_ids |= child.invalid_block_ids
            for req_id in child.finished_sending:
                self._sent_early[req_id] += 1
        # A request held by n connectors is sent when all n have said so.
        for req_id in list(self._sent_early):
            needed = self._sends_left.get(req_id, 1)
            if self._sent_early[req_id] >= needed:
                out.finished_sending.add(req_id)
                del self._sent_early[req_id]
                self._sends_left.pop(req_id, None)
        return out

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()
