"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and allocation.

The scheduler asks two questions per request: "how much of this request is already in the
cache?" (`get_computed_blocks`, once, when the request is admitted from the waiting queue) and
"give this request room for N more tokens" (`allocate_slots`, every step it runs; None means
the pool cannot, and the scheduler must preempt or wait). A request's blocks are a list whose
block i holds its tokens [i * block_size, (i + 1) * block_size); once a block is full and its
tokens are computed it is cached under the request's i-th block hash, so later requests with the
same prefix can share it. `free` returns a finished or preempted request's blocks to the pool.

Beam search forks a request (`fork`): the child shares every block of its parent by reference.
Full blocks are never written again, so sharing them is free; the partly filled last block is
copied the first time one of its holders writes into it (copy-on-write in `allocate_slots`,
one `KVBlockCopy` the runner executes before the step's forward pass).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_utils import KVCacheBlock
from pagedllm.core.sched.output import KVBlockCopy

if TYPE_CHECKING:
    from pagedllm.core.request import Request


@dataclass
class KVCacheBlocks:
    """The blocks the scheduler sees for one request (an opaque handle: the scheduler only asks
    for their ids, to hand them to the model runner)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last `make_prefix_cache_stats()`, counted in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block lists over one `BlockPool`.

    Invariants: `req_to_blocks[r]` holds request r's blocks in token order; each block's ref_cnt
    equals the number of requests whose list holds it; the first `num_cached_block[r]` blocks of
    r are cached (hashed), the rest are not. `check_integrity()` verifies these.
    """

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Copy-on-write block copies since the last take_blocks_to_copy(), in order.
        self._blocks_to_copy: list[KVBlockCopy] = []

    @property
    def usage(self) -> float:
        """Fraction of the KV cache in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of the request's leading full blocks found in the prefix cache, and the
        number of tokens they hold.

        Never the whole request: at most `num_tokens - 1` tokens hit, so at least the last token
        is computed and produces logits. No hits when caching is off or the request wants prompt
        logprobs (those need every prompt position's logits). Takes no references: pass the
        result to `allocate_slots`, which does. Each call counts in the prefix-cache stats (a
        request that waits for blocks is looked up again next step and counted again).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request`; return the newly allocated
        blocks (possibly none), or None, changing nothing, when the pool cannot.

        Block layout of the request after the call (`comp` = request.num_computed_tokens):

        ```
        | < comp: computed  | new computed   | new tokens     | lookahead     |
        | (blocks it holds) | (prefix hits)  | (this step)    | (spec drafts) |
        |<------------------ blocks it already holds + new_computed_blocks -->|
                                               ... new blocks cover the rest, up to
                                               min(total, max_model_len) tokens
        ```

        `new_computed_blocks` / `num_new_computed_tokens` come from `get_computed_blocks` on the
        request's first allocation after admission (pass them only then). Blocks whose tokens
        will all be computed after this step (capped at the request's known tokens, so draft
        tokens never get cached) are added to the prefix cache, unless `delay_cache_blocks`
        (a KV connector is still loading them: the next allocation caches them).
        """
        computed_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else []
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = _cdiv(num_slots, self.block_size) - num_held - len(computed_blocks)
        cow_index = self._shared_write_block(req_blocks, num_computed, num_new_tokens)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        num_needed = num_new_blocks + (cow_index is not None)
        if num_needed > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None
        if cow_index is not None:
            assert req_blocks is not None
            self._copy_on_write(req_id, req_blocks, cow_index)

        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
        if computed_blocks:
            # Touch before get_new_blocks so a free hit block cannot be popped and evicted.
            self.block_pool.touch(computed_blocks)
            req_blocks.extend(computed_blocks)
            self.num_cached_block[req_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)

        if self.enable_caching and not delay_cache_blocks:
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            num_cached = self.num_cached_block[req_id]
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full)
                self.num_cached_block[req_id] = num_full
        return KVCacheBlocks(new_blocks)

    def _shared_write_block(
        self, req_blocks: list[KVCacheBlock] | None, num_computed: int, num_new_tokens: int
    ) -> int | None:
        """Index of the block this step writes into that another request also holds (only a
        forked beam's partly filled last block can be), or None."""
        if not req_blocks or num_new_tokens <= 0 or num_computed % self.block_size == 0:
            return None
        index = num_computed // self.block_size
        if index < len(req_blocks) and req_blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, req_id: str, req_blocks: list[KVCacheBlock], index: int) -> None:
        shared = req_blocks[index]
        private = self.block_pool.get_new_blocks(1)[0]
        req_blocks[index] = private
        self.block_pool.free_blocks([shared])  # its other holders keep it
        self._blocks_to_copy.append(KVBlockCopy(req_id, index, shared.block_id, private.block_id))

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` (a beam forked from `parent`, with the same tokens computed) all of
        the parent's blocks, shared by reference (see the module docstring)."""
        blocks = self.req_to_blocks[parent.request_id]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_block[child.request_id] = self.num_cached_block[parent.request_id]

    def take_blocks_to_copy(self) -> list[KVBlockCopy]:
        """The copy-on-write copies made since the last call (for this step's runner)."""
        copies, self._blocks_to_copy = self._blocks_to_copy, []
        return copies

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (a no-op for a request holding none). Its blocks
        go back last-to-first, so its tail blocks are evicted before its shareable prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a fresh list)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call; resets them."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; fails (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. O(num_blocks): cheap enough
        to run whenever the engine is idle, and after every test."""
        pool = self.block_pool
        holders = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        for block in pool.blocks:
            if block.ref_cnt != holders[block.block_id]:
                raise AssertionError(
                    f"{block}: ref_cnt is {block.ref_cnt} but {holders[block.block_id]} "
                    "requests hold it"
                )
        free = pool.free_block_queue.get_all_free_blocks()
        if len(free) != pool.get_num_free_blocks():
            raise AssertionError(
                f"free queue links {len(free)} blocks, counter says {pool.get_num_free_blocks()}"
            )
        num_unreferenced = sum(1 for b in pool.blocks if b.ref_cnt == 0)
        if any(b.ref_cnt != 0 for b in free) or num_unreferenced != len(free):
            raise AssertionError("free queue and zero ref counts disagree")
        num_mapped = 0
        for block_hash, blocks in pool.cached_block_hash_to_block.items():
            for block in blocks.values():
                num_mapped += 1
                if block.block_hash != block_hash:
                    raise AssertionError(f"{block} is mapped under another hash")
        if num_mapped != sum(1 for b in pool.blocks if b.block_hash is not None):
            raise AssertionError("a hashed block is missing from the prefix-cache map")
        for req_id, blocks in self.req_to_blocks.items():
            num_cached = self.num_cached_block.get(req_id, 0)
            if any(b.block_hash is None for b in blocks[:num_cached]):
                raise AssertionError(f"request {req_id}: a block counted as cached has no hash")
