"""BlockPool: every KV block, the free queue, and the prefix-cache map from hash to block.

Lifecycle of a block: it starts in the free queue; `get_new_blocks` pops it (ref_cnt 1); when
it becomes full, `cache_full_blocks` records its hash in `cached_block_hash_to_block`; when its
last user frees it (ref_cnt 0) it goes back to the *tail* of the free queue but keeps its hash,
so it can still be hit; a hit on such a free block (`touch`) pulls it out of the queue again.
Eviction is lazy: only when `get_new_blocks` hands a free block out does its stale hash leave
the map. So the free queue holds both never-used and cached-but-unused blocks, and
"free" always means "can be handed out now".

No block is reserved: block ids run 0..num_blocks-1 and all are usable. (A runner that pads its
batch must point padded tokens at slot -1, not at block 0.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from pagedllm.core.request import Request


class BlockPool:
    """Owns all `num_blocks` blocks. Invariants: a block is in the free queue iff its
    `ref_cnt == 0`; every block in `cached_block_hash_to_block[h]` has `block_hash == h`; a block
    with a hash is in the map (with caching off no block ever gets a hash)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}. Several blocks can share a hash when two requests computed
        # the same prefix in the same step, before either was cached.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block holding `block_hash`'s KV, or None."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Cache `blocks[num_cached_blocks:num_full_blocks]`, the request's blocks that became
        full since the last call, under `request.block_hashes[i]`.

        Requires `len(request.block_hashes) >= num_full_blocks` and the blocks to be uncached.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise AssertionError(
                f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
                f"{num_full_blocks} full blocks to cache"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            assert block.block_hash is None, f"{block} is already cached"
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue (least recently used first), evict
        their stale hashes, and give each ref_cnt 1. ValueError if not enough are free."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if blocks is not None:
            blocks.pop(block.block_id, None)
            if not blocks:
                del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the free queue (it is no
        longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 join the free queue's tail in the
        given order, so the first given are evicted first. Callers pass a request's blocks
        last-to-first: its tail blocks (least likely to be shared) are then evicted before its
        prefix blocks."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use (otherwise a running
        request's blocks would lose their hashes mid-flight); returns whether it happened."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (0.0 to 1.0); cached-but-free blocks count as free."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
