"""Tests for pagedllm.core.block_pool: LRU eviction, ref counts, lazy eviction, touch, reset."""

import pytest

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_utils import hash_block_tokens, update_request_block_hashes
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(req_id: str, prompt: list[int]) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=8))
    update_request_block_hashes(request, BLOCK_SIZE)
    return request


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool):
    return ids(pool.free_block_queue.get_all_free_blocks())


def test_new_blocks_take_references_and_free_returns_them():
    pool = BlockPool(num_blocks=6)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 3
    assert pool.get_usage() == pytest.approx(0.5)
    pool.touch(blocks[:1])  # a second user
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1
    assert pool.get_num_free_blocks() == 5
    pool.free_blocks(blocks[:1])
    assert pool.get_num_free_blocks() == 6
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks[:1])
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)


def test_lru_eviction_order():
    pool = BlockPool(num_blocks=4)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(2)  # 2, 3
    # Free b first, then a in reverse: the least recently freed comes out first.
    pool.free_blocks(b)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [2, 3, 1, 0]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 1]


def test_cached_blocks_survive_free_and_are_evicted_lazily():
    pool = BlockPool(num_blocks=3)
    request = make_request("r0", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 full blocks of 4
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=2)
    h0, h1 = request.block_hashes
    assert pool.get_cached_block(h0) is blocks[0]
    assert pool.get_cached_block(h1) is blocks[1]
    assert blocks[2].block_hash is None

    pool.free_blocks(reversed(blocks))  # tail first: 2, 1, 0
    assert free_ids(pool) == [2, 1, 0]
    # Freed but still cached: a later request can hit them.
    assert pool.get_cached_block(h0) is blocks[0]
    # Handing out block 2 (uncached) and then block 1 evicts only block 1's hash.
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.get_cached_block(h1) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(h0) is blocks[0]


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(num_blocks=3)
    request = make_request("r0", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(request.block_hashes[0])
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    assert hit.block_id not in free_ids(pool)
    # The next new blocks skip it, and it keeps its hash.
    assert hit.block_id not in ids(pool.get_new_blocks(2))
    assert pool.get_cached_block(request.block_hashes[0]) is hit


def test_two_blocks_with_the_same_hash():
    pool = BlockPool(num_blocks=4)
    r0, r1 = make_request("r0", [1, 2, 3, 4]), make_request("r1", [1, 2, 3, 4])
    b0, b1 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(r0, b0, 0, 1)
    pool.cache_full_blocks(r1, b1, 0, 1)
    h = r0.block_hashes[0]
    assert set(pool.cached_block_hash_to_block[h]) == {b0[0].block_id, b1[0].block_id}
    pool.free_blocks(b0 + b1)
    pool.get_new_blocks(2)  # the two never-used blocks
    pool.get_new_blocks(1)  # evicts b0's copy; b1's stays reachable
    assert pool.get_cached_block(h) is b1[0]


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(num_blocks=2)
    request = make_request("r0", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert blocks[0].block_hash is None
    assert not pool.cached_block_hash_to_block


def test_caching_disabled_never_caches():
    pool = BlockPool(num_blocks=2, enable_caching=False)
    request = make_request("r0", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert blocks[0].block_hash is None
    assert pool.get_cached_block(request.block_hashes[0]) is None


def test_hash_chain_distinguishes_equal_blocks_with_different_prefixes():
    pool = BlockPool(num_blocks=4)
    r0 = make_request("r0", [1, 2, 3, 4, 9, 9, 9, 9])
    r1 = make_request("r1", [5, 6, 7, 8, 9, 9, 9, 9])
    pool.cache_full_blocks(r0, pool.get_new_blocks(2), 0, 2)
    assert r0.block_hashes[1] != r1.block_hashes[1]
    assert pool.get_cached_block(r1.block_hashes[1]) is None
    assert r0.block_hashes[1] == hash_block_tokens(r0.block_hashes[0], [9, 9, 9, 9])
