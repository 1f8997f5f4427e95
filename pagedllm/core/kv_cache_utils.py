"""KV cache blocks, the free-block queue, and the block hashes behind the prefix cache.

A request's tokens are cut into fixed-size blocks. Every *full* block gets a hash that chains
its parent block's hash, its own token ids and any extra keys (e.g. a LoRA name or a cache salt),
so equal hashes mean equal whole prefixes, not just equal blocks. The block pool maps those
hashes to physical blocks; a new request whose leading block hashes are found there reuses the
blocks' KV instead of recomputing it.

Hash choice: SHA-256 over a msgpack encoding of `(parent_hash, token_ids, extra_keys)`. A
collision would silently serve one prompt's KV to another (a correctness and an isolation bug),
so a 64-bit `hash()` of a tuple is not good enough; and SHA-256 is deterministic across processes
(unlike `hash()` of strings, which PYTHONHASHSEED salts), so engines and KV connectors can compare
hashes. msgpack is self-delimiting and canonical for ints, strings, bytes and tuples (pickle is
not: its memo makes equal values encode differently). Cost: about a microsecond per block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NewType

import msgspec

if TYPE_CHECKING:
    from pagedllm.core.request import Request

# A SHA-256 digest (32 bytes): hashable, cheap to compare, the same in every process.
BlockHash = NewType("BlockHash", bytes)

# Parent of a request's first block: a fixed constant, so hashes are reproducible everywhere.
ROOT_BLOCK_HASH = BlockHash(hashlib.sha256(b"pagedllm.block_hash.root").digest())

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block: depends on every token before it (through `parent_hash`), its
    own `token_ids`, and `extra_keys` (ints / strings / bytes / tuples of them)."""
    parent = ROOT_BLOCK_HASH if parent_hash is None else parent_hash
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)
    payload = _encoder.encode((parent, token_ids, extra_keys))
    return BlockHash(hashlib.sha256(payload).digest())


def update_request_block_hashes(
    request: Request, block_size: int, extra_keys: tuple[Any, ...] | None = None
) -> int:
    """Extend `request.block_hashes` with the hashes of blocks of `request.all_token_ids` that
    have become full since the last call; return how many were added.

    Call it whenever tokens are appended. Invariant afterwards:
    `len(request.block_hashes) == request.num_tokens // block_size`. A request's
    `cache_salt` enters the first block's hash (and so, chained, every later one): requests
    share cached prefixes only within the same salt (vLLM's prefix-cache namespaces).
    """
    hashes = request.block_hashes
    start = len(hashes)
    num_full = request.num_tokens // block_size
    if num_full <= start:
        return 0
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(start, num_full):
        keys = extra_keys
        if i == 0 and request.cache_salt is not None:
            keys = (*(extra_keys or ()), request.cache_salt)
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return num_full - start


class KVCacheBlock:
    """One physical block of the paged KV cache.

    `ref_cnt` counts the requests using the block. `block_hash` is set once the block is full and
    cached; it survives while the block sits in the free queue (so a later request can still hit
    it) and is cleared only when the block is handed out again. `prev_free_block` /
    `next_free_block` are the free queue's links: both set exactly while the block is in the queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: the head is handed out (and evicted) first.

    A hand-made doubly linked list through the blocks' own `prev_free_block`/`next_free_block`
    fields, with two sentinel nodes so no operation branches on "empty" or "at an end". Python's
    deque cannot remove from the middle in O(1), and that is the operation a prefix-cache hit on
    a free block needs (`BlockPool.touch`). Freed blocks are appended at the tail, so the head is
    always the least recently freed block: LRU eviction keeps recently used prefixes cached the
    longest. Initially the blocks are queued in id order.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block; ValueError when empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks; ValueError (and nothing removed) if fewer."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue, in O(1)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queued blocks, head first (O(n); for tests and integrity checks)."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out
