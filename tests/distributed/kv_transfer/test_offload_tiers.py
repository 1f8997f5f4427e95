"""The offloading tiers (offload_tiers.py): LRU eviction that spares pinned hashes, and block
files that are written atomically, checked by size and found again by a rescan."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.core.kv_cache_utils import BlockHash
from pagedllm.distributed.kv_transfer.offload_tiers import (
    LRUBlockIndex,
    read_block_file,
    scan_block_files,
    write_block_file,
)


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_lru_evicts_least_recently_used_unpinned():
    index = LRUBlockIndex(2)
    slot_a, _ = index.insert(h(1))
    index.insert(h(2))
    index.touch(h(1))  # h(2) is now the least recently used
    slot_c, evicted = index.insert(h(3))
    assert evicted == [h(2)] and h(2) not in index and len(index) == 2
    index.pin(h(1))
    index.pin(h(3))
    assert index.insert(h(4)) is None  # everything pinned: nothing is evicted
    index.unpin(h(1))
    slot_d, evicted = index.insert(h(4))
    assert evicted == [h(1)] and slot_d == slot_a
    assert sorted([index.get(h(3)), index.get(h(4))]) == [0, 1]


def test_block_files_roundtrip_and_rescan(tmp_path):
    directory = str(tmp_path)
    blocks = {h(i): torch.randn(3, 10) for i in (5, 6)}
    for block_hash, data in blocks.items():
        write_block_file(directory, block_hash.hex(), data)
    (tmp_path / ".tmp-123-half").write_bytes(b"x")  # a crash mid-write
    (tmp_path / (h(9).hex() + ".kv")).write_bytes(b"short")
    os.utime(tmp_path / (h(5).hex() + ".kv"), (1, 1))  # h(5) is the oldest
    assert scan_block_files(directory, 3 * 10 * 4) == [h(5), h(6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [h(5).hex() + ".kv", h(6).hex() + ".kv"]
    )
    out = torch.empty(3, 10)
    read_block_file(directory, h(6).hex(), out)
    assert torch.equal(out, blocks[h(6)])
    with pytest.raises(OSError):
        read_block_file(directory, h(7).hex(), out)
    with pytest.raises(OSError, match="does not hold"):
        read_block_file(directory, h(6).hex(), torch.empty(3, 11))
