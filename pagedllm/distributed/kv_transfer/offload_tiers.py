"""The offloading connector's tiers: an LRU index per tier (scheduler side) and the block
files of the disk tier (worker side).

`LRUBlockIndex` maps block hashes to slots of a fixed-capacity tier (rows of the CPU buffer,
or files on disk): least recently used first, evicted on insert when full. A pinned hash (a
load is about to read it, or it was written this step) is never evicted.

On disk a block is one file, `<hash hex>.kv`, holding the block's bytes for all layers
(`[num_layers, block_numel]`, the KV dtype, nothing else: its size is its check). Files are
written to a temporary name and renamed, so a crash leaves no half block behind; a restart
scans the directory and rebuilds the index, oldest modification time first (a load refreshes
it).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict

import torch

from pagedllm.core.kv_cache_utils import BlockHash

BLOCK_FILE_SUFFIX = ".kv"


class LRUBlockIndex:
    """Block hash -> slot in `range(capacity)`, in LRU order. Not thread-safe (the
    scheduler's thread only)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: Counter[BlockHash] = Counter()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, block_hash: BlockHash) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """Mark as most recently used."""
        self._slots.move_to_end(block_hash)

    def insert(self, block_hash: BlockHash) -> tuple[int, list[BlockHash]] | None:
        """A slot for a new hash (most recently used), evicting the least recently used
        unpinned ones as needed; (slot, evicted hashes), or None when all are pinned."""
        assert block_hash not in self._slots, "insert of a hash already in the tier"
        evicted = []
        if not self._free:
            victim = next((h for h in self._slots if not self._pins[h]), None)
            if victim is None:
                return None
            self._free.append(self._slots.pop(victim))
            evicted.append(victim)
        slot = self._free.pop()
        self._slots[block_hash] = slot
        return slot, evicted

    def remove(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def pin(self, block_hash: BlockHash) -> None:
        self._pins[block_hash] += 1

    def unpin(self, block_hash: BlockHash) -> None:
        self._pins[block_hash] -= 1
        if self._pins[block_hash] <= 0:
            del self._pins[block_hash]


def block_file(directory: str, name: str) -> str:
    """The file of the block whose hash hex is `name`."""
    return os.path.join(directory, name + BLOCK_FILE_SUFFIX)


def scan_block_files(directory: str, block_bytes: int) -> list[BlockHash]:
    """The hashes of the complete block files in `directory`, least recently used first.
    Leftover temporary files (a crash mid-write) and files of the wrong size are removed."""
    if not os.path.isdir(directory):
        return []
    found: list[tuple[float, BlockHash]] = []
    for entry in os.scandir(directory):
        if entry.name.startswith(".tmp-"):
            os.unlink(entry.path)
            continue
        stem, suffix = os.path.splitext(entry.name)
        if suffix != BLOCK_FILE_SUFFIX:
            continue
        stat = entry.stat()
        if stat.st_size != block_bytes:
            os.unlink(entry.path)
            continue
        found.append((stat.st_mtime, BlockHash(bytes.fromhex(stem))))
    found.sort()
    return [h for _, h in found]


def write_block_file(directory: str, name: str, data: torch.Tensor) -> None:
    """Write one block (`[num_layers, block_numel]`, on the CPU) atomically."""
    path = block_file(directory, name)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    with open(tmp, "wb") as f:
        f.write(data.contiguous().view(torch.uint8).numpy().data)
    os.replace(tmp, path)


def read_block_file(directory: str, name: str, out: torch.Tensor) -> None:
    """Read one block into `out` (a contiguous CPU `[num_layers, block_numel]` tensor);
    OSError if the file is missing or short. Refreshes the file's time (LRU across restarts)."""
    path = block_file(directory, name)
    buf = out.view(torch.uint8).numpy()
    with open(path, "rb") as f:
        if f.readinto(buf.data) != buf.size or f.read(1):
            raise OSError(f"{path} does not hold one KV block of {buf.size} bytes")
    os.utime(path)
