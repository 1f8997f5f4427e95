"""A scripted KV connector for scheduler tests: offers `offer[req_id]` tokens (asynchronously
when `load_async`), records every call, and holds finished requests named in `hold`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata


@dataclass
class FakeMetadata(KVConnectorMetadata):
    loads: list[tuple[str, list[int], int]] = field(default_factory=list)


class FakeKVConnector(KVConnectorBase_V1):
    def __init__(self, config, role) -> None:
        super().__init__(config, role)
        self.offer: dict[str, int] = {}
        self.load_async = True
        self.hold: set[str] = set()
        self.calls: list[tuple] = []
        self._loads: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return self.offer.get(request.request_id, 0), self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens))
        if num_external_tokens:
            self._loads.append((request.request_id, blocks.get_block_ids(), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        meta, self._loads = FakeMetadata(self._loads), []
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        if request.request_id in self.hold:
            return True, {"held": request.request_id}
        return False, None

    def start_load_kv(self) -> None:
        return None
