"""`SharedStorageConnector`: a prompt's KV blocks as files under a shared path (vLLM's
reference connector, here keyed by block hashes).

Saving (kv_producer / kv_both): in the step that completes a request's prompt, its first
`k = (prompt_len - 1) // block_size` blocks are written, one safetensors file per attention
layer (`save_kv_layer`, right after the layer computed them), into a directory named by the
hex of block hash `k - 1`. A block hash chains every token before it, so that name identifies
the whole k-block prefix. The directory is written under a temporary name and renamed when the
step's forward is over (`wait_for_save`), so a reader never sees half of it.

Loading (kv_consumer / kv_both): a new request looks for the longest of its prefixes stored
(beyond its local prefix-cache hit) and loads those blocks asynchronously (the request waits
in WAITING_FOR_REMOTE_KVS; an unreadable file means its tokens are computed locally).

Files live in `shared_storage_path/<fingerprint>/` (see `kv_blocks.kv_cache_fingerprint`), so
engines with another model or dtype never read them. Nothing is ever deleted: this connector
is the simple one; the `OffloadingConnector` bounds its disk use.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import safetensors.torch

from pagedllm.distributed.kv_transfer.background import BackgroundTransfers
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    check_extra_config,
    track_scheduled_blocks,
)
from pagedllm.distributed.kv_transfer.kv_blocks import (
    PagedKVBlocks,
    claim_layout,
    kv_cache_fingerprint,
)

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheBlocks
    from pagedllm.core.request import Request
    from pagedllm.core.sched.output import SchedulerOutput
    from pagedllm.outputs import KVConnectorOutput

DEFAULT_PATH = "/tmp"  # vLLM's default shared_storage_path


@dataclass
class StorageJob:
    """Blocks `file_blocks` of the prefix stored under `name`, to or from local `block_ids`."""

    req_id: str
    name: str
    file_blocks: range
    block_ids: list[int]


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    loads: list[StorageJob] = field(default_factory=list)
    saves: list[StorageJob] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase_V1):
    """See the module docstring. Extra config: `shared_storage_path` (default /tmp)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        extra = self.kv_transfer_config.kv_connector_extra_config
        root = extra.get("shared_storage_path", DEFAULT_PATH)
        self.directory = os.path.join(root, "pagedllm-kv", kv_cache_fingerprint(config))
        # Scheduler side: admitted requests, their block ids, and this step's loads.
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._loads: list[StorageJob] = []
        # Worker side.
        self._kv: PagedKVBlocks | None = None
        self._transfers: BackgroundTransfers | None = None
        if role == KVConnectorRole.WORKER:
            self._transfers = BackgroundTransfers("kv-shared-storage")

    @classmethod
    def validate_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        check_extra_config(kv_transfer_config, cls.__name__, {"shared_storage_path": str})

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        for k in range((request.num_tokens - 1) // self.block_size, first, -1):
            if os.path.isdir(self._path(request.block_hashes[k - 1].hex())):
                return k * self.block_size - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        end = (request.num_computed_tokens + num_external_tokens) // self.block_size
        self._loads.append(
            StorageJob(
                request.request_id,
                request.block_hashes[end - 1].hex(),
                range(first, end),
                blocks.get_block_ids()[first:end],
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._loads)
        self._loads = []
        starts = track_scheduled_blocks(scheduler_output, self._block_ids)
        if not self.kv_transfer_config.is_kv_producer:
            return meta
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests[req_id]
            prompt_len = request.num_prompt_tokens
            # Saved in the step that completes the prompt, when every prompt block holds KV.
            if not starts[req_id] < prompt_len <= starts[req_id] + num_tokens:
                continue
            k = (prompt_len - 1) // self.block_size
            if k == 0:
                continue
            name = request.block_hashes[k - 1].hex()
            if name not in {job.name for job in meta.saves} and not os.path.isdir(self._path(name)):
                meta.saves.append(StorageJob(req_id, name, range(k), self._block_ids[req_id][:k]))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self._requests.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_dim: int,
        kv_scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        self._kv = PagedKVBlocks(kv_caches, block_dim, kv_scales)
        claim_layout(self.directory, self._kv.describe())

    def start_load_kv(self) -> None:
        meta: SharedStorageMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        assert self._transfers is not None
        for job in meta.loads:
            self._transfers.submit(job.req_id, job.block_ids, lambda job=job: self._load(job))

    def _load(self, job: StorageJob) -> None:
        kv = self._kv
        assert kv is not None
        folder = self._path(job.name)
        for layer in range(kv.num_layers):
            data = safetensors.torch.load_file(os.path.join(folder, f"{layer}.safetensors"))["kv"]
            kv.scatter(layer, job.block_ids, data[job.file_blocks.start : job.file_blocks.stop])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        meta: SharedStorageMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        if not meta.saves:
            return
        kv = self._kv
        assert kv is not None
        layer = kv.layer_index[layer_name]
        for job in meta.saves:
            folder = self._tmp_path(job.name)
            os.makedirs(folder, exist_ok=True)
            data = kv.gather(layer, job.block_ids).cpu()
            safetensors.torch.save_file({"kv": data}, os.path.join(folder, f"{layer}.safetensors"))

    def _tmp_path(self, name: str) -> str:
        return self._path(f".tmp-{os.getpid()}-{name}")

    def wait_for_save(self) -> None:
        meta: SharedStorageMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        for job in meta.saves:
            try:
                os.rename(self._tmp_path(job.name), self._path(job.name))
            except OSError:  # saved meanwhile by another engine: theirs is as good
                shutil.rmtree(self._tmp_path(job.name), ignore_errors=True)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        assert self._transfers is not None
        return self._transfers.take_finished()

    def shutdown(self) -> None:
        if self._transfers is not None:
            self._transfers.shutdown()
