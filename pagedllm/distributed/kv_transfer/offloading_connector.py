"""`OffloadingConnector`: a CPU-memory tier and a disk tier behind the engine's KV cache,
keyed by the prefix cache's block hashes, LRU-evicted, size-limited; the disk tier survives
restarts (a persistent prefix cache).

Stores (kv_producer / kv_both): every full block a step computes, or a request got from
elsewhere, goes to the tiers it is not in yet: into a CPU-buffer row, copied layer by layer
right after each attention layer wrote it (`save_kv_layer`), and into a block file (written
once the forward is over, `wait_for_save`). Storing on compute, not on eviction, means the
device tier never waits for a copy and everything computed is on disk at once.

Loads (kv_consumer / kv_both): a new request's blocks after its local prefix-cache hit are
looked up in the CPU tier, then on disk, block by block, until one is missing. Blocks all in
CPU memory load synchronously (the request runs in the same step; each layer's rows are
copied just before that layer attends, `wait_for_layer_load`); any block on disk makes the
load asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while a background thread
reads the files, and an unreadable file drops that block from the index and the request is
computed locally).

Only the scheduler side decides: which hash lives in which CPU row and which files exist
(`LRUBlockIndex` per tier, rebuilt from the directory at start). The worker side only copies
what the metadata says. A row or file a load will read is pinned until the load is done, and
one written this step until the next, so no eviction ever races a copy.

Extra config: `cpu_bytes_to_use` or `num_cpu_blocks` (the CPU tier; 0 / absent: none),
`disk_path` (the disk tier's root; absent: none), `disk_bytes_to_use` (its size, default
8 GiB). Files live in `disk_path/<fingerprint>/` (see `kv_blocks.kv_cache_fingerprint`); use
one disk path per running engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

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
from pagedllm.distributed.kv_transfer.offload_tiers import (
    LRUBlockIndex,
    block_file,
    read_block_file,
    scan_block_files,
    write_block_file,
)
from pagedllm.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, KVTransferConfig
    from pagedllm.core.kv_cache_manager import KVCacheBlocks
    from pagedllm.core.kv_cache_utils import BlockHash
    from pagedllm.core.request import Request
    from pagedllm.core.sched.output import SchedulerOutput

DEFAULT_DISK_BYTES = 8 << 30


@dataclass
class OffloadLoad:
    """Load `block_ids[i]` from CPU row `sources[i]` (an int) or block file `sources[i]`
    (a hash hex)."""

    req_id: str
    block_ids: list[int]
    sources: list[int | str]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    sync_loads: list[OffloadLoad] = field(default_factory=list)
    async_loads: list[OffloadLoad] = field(default_factory=list)
    # Device block -> CPU row, and device block -> file (hash hex), after the forward.
    cpu_stores: list[tuple[int, int]] = field(default_factory=list)
    disk_stores: list[tuple[int, str]] = field(default_factory=list)
    disk_deletes: list[str] = field(default_factory=list)


def kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one KV block over all of the model's layers (what the worker will find)."""
    mc = config.model_config
    per_layer = 2 * config.cache_config.block_size * mc.num_kv_heads * mc.head_dim
    return mc.num_layers * per_layer * config.kv_cache_torch_dtype.itemsize


class OffloadingConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        extra = self.kv_transfer_config.kv_connector_extra_config
        self.block_bytes = kv_bytes_per_block(config)
        self.num_cpu_blocks = int(
            extra.get("num_cpu_blocks", extra.get("cpu_bytes_to_use", 0) // self.block_bytes)
        )
        self.disk_dir: str | None = None
        if extra.get("disk_path"):
            self.disk_dir = os.path.join(
                extra["disk_path"], "pagedllm-kv", kv_cache_fingerprint(config)
            )
        self.num_disk_blocks = int(extra.get("disk_bytes_to_use", DEFAULT_DISK_BYTES)) // (
            self.block_bytes
        )
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler_side()
        else:
            self._kv: PagedKVBlocks | None = None
            self._cpu: torch.Tensor | None = None  # [num_cpu_blocks, num_layers, block_numel]
            # This step's synchronous loads: (device blocks, their CPU rows).
            self._sync_load: tuple[list[int], torch.Tensor] | None = None
            self._transfers = BackgroundTransfers("kv-offload")

    @classmethod
    def validate_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        allowed = {
            "cpu_bytes_to_use": int,
            "num_cpu_blocks": int,
            "disk_path": str,
            "disk_bytes_to_use": int,
        }
        check_extra_config(kv_transfer_config, cls.__name__, allowed)
        extra = kv_transfer_config.kv_connector_extra_config
        if "cpu_bytes_to_use" in extra and "num_cpu_blocks" in extra:
            raise ValueError("give cpu_bytes_to_use or num_cpu_blocks, not both")
        for key in ("cpu_bytes_to_use", "num_cpu_blocks", "disk_bytes_to_use"):
            if extra.get(key, 0) < 0:
                raise ValueError(f"kv_connector_extra_config[{key!r}]={extra[key]} must be >= 0")
        if not (extra.get("cpu_bytes_to_use") or extra.get("num_cpu_blocks")) and not extra.get(
            "disk_path"
        ):
            raise ValueError(
                "the OffloadingConnector needs a tier: set cpu_bytes_to_use (or num_cpu_blocks) "
                "and / or disk_path in kv_connector_extra_config"
            )

    # ---- scheduler side -----------------------------------------------------------------------

    def _init_scheduler_side(self) -> None:
        self._cpu_index = LRUBlockIndex(self.num_cpu_blocks)
        self._disk_index = LRUBlockIndex(self.num_disk_blocks if self.disk_dir else 0)
        if self.disk_dir is not None:
            for block_hash in scan_block_files(self.disk_dir, self.block_bytes):
                self._insert(self._disk_index, block_hash, [])
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_stored: dict[str, int] = {}  # blocks of a request already offered to tiers
        self._meta = OffloadMetadata()
        # Pins of the step being built (synchronous loads, stores), released when the next
        # step is built; pins of asynchronous loads (and their load), released when they end.
        self._admission_pins: list[tuple[LRUBlockIndex, BlockHash]] = []
        self._step_pins: list[tuple[LRUBlockIndex, BlockHash]] = []
        self._async_loads: dict[str, tuple[OffloadLoad, list[tuple[LRUBlockIndex, BlockHash]]]] = {}

    def _insert(
        self, index: LRUBlockIndex, block_hash: BlockHash, deletes: list[str]
    ) -> int | None:
        """Add a hash to a tier (evicted files go to `deletes`); its slot, or None if full."""
        placed = index.insert(block_hash)
        if placed is None:
            return None
        slot, evicted = placed
        if index is self._disk_index:
            deletes.extend(h.hex() for h in evicted)
        return slot

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        num_blocks, on_disk = 0, False
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self._cpu_index:
                if block_hash not in self._disk_index:
                    break
                on_disk = True
            num_blocks += 1
        return num_blocks * self.block_size, on_disk and num_blocks > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._num_stored[req_id] = 0
        if num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        hashes = request.block_hashes[first:end]
        sources: list[int | str] = []
        pins = []
        for block_hash in hashes:
            index = self._cpu_index if block_hash in self._cpu_index else self._disk_index
            index.pin(block_hash)
            index.touch(block_hash)
            pins.append((index, block_hash))
            slot = index.get(block_hash)
            sources.append(slot if index is self._cpu_index else block_hash.hex())  # type: ignore[arg-type]
        load = OffloadLoad(req_id, blocks.get_block_ids()[first:end], sources)
        if all(isinstance(s, int) for s in sources):
            self._meta.sync_loads.append(load)
            self._admission_pins.extend(pins)
        else:
            self._meta.async_loads.append(load)
            self._async_loads[req_id] = (load, pins)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        for index, block_hash in self._step_pins:  # the last step's copies are done
            index.unpin(block_hash)
        self._step_pins, self._admission_pins = self._admission_pins, []
        meta, self._meta = self._meta, OffloadMetadata()
        starts = track_scheduled_blocks(scheduler_output, self._block_ids)
        if self.kv_transfer_config.is_kv_producer:
            for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                self._add_stores(req_id, starts[req_id] + num_tokens, meta)
        return meta

    def _add_stores(self, req_id: str, num_computed_after: int, meta: OffloadMetadata) -> None:
        """Offer the request's blocks that are full after this step to every tier."""
        request = self._requests[req_id]
        end = min(num_computed_after, request.num_tokens) // self.block_size
        block_ids = self._block_ids[req_id]
        for i in range(self._num_stored[req_id], end):
            block_hash = request.block_hashes[i]
            for index, stores in (
                (self._cpu_index, meta.cpu_stores),
                (self._disk_index, meta.disk_stores),
            ):
                if index.capacity == 0:
                    continue
                if block_hash in index:
                    index.touch(block_hash)
                    continue
                slot = self._insert(index, block_hash, meta.disk_deletes)
                if slot is None:
                    continue
                index.pin(block_hash)
                self._step_pins.append((index, block_hash))
                target = slot if index is self._cpu_index else block_hash.hex()
                stores.append((block_ids[i], target))  # type: ignore[arg-type]
        self._num_stored[req_id] = max(end, self._num_stored[req_id])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving:
            load, pins = self._async_loads.pop(req_id, (None, []))
            for index, block_hash in pins:
                index.unpin(block_hash)
            if load is None or connector_output.invalid_block_ids.isdisjoint(load.block_ids):
                continue
            # Which file failed is not known: forget all of the load's disk blocks.
            for block_hash in (h for i, h in pins if i is self._disk_index):
                if block_hash in self._disk_index:
                    self._disk_index.remove(block_hash)
                    self._meta.disk_deletes.append(block_hash.hex())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        for table in (self._requests, self._block_ids, self._num_stored):
            table.pop(request.request_id, None)
        return False, None

    def has_pending_transfers(self) -> bool:
        return bool(self._async_loads)

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_dim: int,
        kv_scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        self._kv = kv = PagedKVBlocks(kv_caches, block_dim, kv_scales)
        if kv.bytes_per_block != self.block_bytes:
            raise ValueError(
                f"the KV cache holds {kv.bytes_per_block} bytes per block, the OffloadingConnector "
                f"expected {self.block_bytes} (a model whose layers differ is not supported)"
            )
        if self.num_cpu_blocks:
            self._cpu = torch.empty(
                (self.num_cpu_blocks, kv.num_layers, kv.block_numel), dtype=kv.dtype
            )
        if self.disk_dir is not None:
            claim_layout(self.disk_dir, kv.describe())

    def start_load_kv(self) -> None:
        meta: OffloadMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        self._sync_load = None
        if meta.sync_loads:
            # Copied layer by layer, each just before that layer attends.
            block_ids = [b for load in meta.sync_loads for b in load.block_ids]
            rows = torch.tensor([s for load in meta.sync_loads for s in load.sources])
            self._sync_load = (block_ids, rows)
        for load in meta.async_loads:
            self._transfers.submit(load.req_id, load.block_ids, lambda ld=load: self._load(ld))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._sync_load is None:
            return
        assert self._kv is not None and self._cpu is not None
        block_ids, rows = self._sync_load
        layer = self._kv.layer_index[layer_name]
        self._kv.scatter(layer, block_ids, self._cpu[rows, layer])

    def _load(self, load: OffloadLoad) -> None:
        """An asynchronous load (background thread): CPU rows and block files."""
        kv = self._kv
        assert kv is not None
        data = torch.empty((len(load.block_ids), kv.num_layers, kv.block_numel), dtype=kv.dtype)
        for i, source in enumerate(load.sources):
            if isinstance(source, int):
                assert self._cpu is not None
                data[i] = self._cpu[source]
            else:
                assert self.disk_dir is not None
                read_block_file(self.disk_dir, source, data[i])
        for layer in range(kv.num_layers):
            kv.scatter(layer, load.block_ids, data[:, layer])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object) -> None:
        meta: OffloadMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        if not meta.cpu_stores:
            return
        assert self._kv is not None and self._cpu is not None
        layer = self._kv.layer_index[layer_name]
        block_ids, rows = zip(*meta.cpu_stores)
        data = self._kv.gather(layer, list(block_ids))
        self._cpu[list(rows), layer] = data.view(len(rows), -1).to("cpu")

    def wait_for_save(self) -> None:
        meta: OffloadMetadata = self._get_connector_metadata()  # type: ignore[assignment]
        self._sync_load = None
        if self.disk_dir is None:
            return
        for name in meta.disk_deletes:
            try:
                os.unlink(block_file(self.disk_dir, name))
            except FileNotFoundError:
                pass
        if not meta.disk_stores:
            return
        kv = self._kv
        assert kv is not None
        block_ids = [b for b, _ in meta.disk_stores]
        data = torch.empty((len(block_ids), kv.num_layers, kv.block_numel), dtype=kv.dtype)
        for layer in range(kv.num_layers):
            data[:, layer] = kv.gather(layer, block_ids).view(len(block_ids), -1).to("cpu")
        for i, (_, name) in enumerate(meta.disk_stores):
            write_block_file(self.disk_dir, name, data[i])

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self._transfers.take_finished()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._transfers.shutdown()
