"""Tests for pagedllm.core.kv_cache_utils: the free-block queue and block hashing."""

import pytest

from pagedllm.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    update_request_block_hashes,
)
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_starts_in_id_order_and_pops_from_head():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert len(queue) == 2
    popped = blocks[0]
    assert popped.prev_free_block is None and popped.next_free_block is None


def test_free_queue_remove_from_middle_and_append_at_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[4])  # the tail
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2, 0]
    assert len(queue) == 4
    assert ids(queue.popleft_n(4)) == [1, 3, 2, 0]
    assert len(queue) == 0


def test_free_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        queue.append(blocks[0])  # already queued
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert len(queue) == 2  # a failed popleft_n removes nothing
    queue.popleft_n(2)
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[1])


def test_hash_is_deterministic_and_chains_the_parent():
    tokens = list(range(16))
    h1 = hash_block_tokens(None, tokens)
    assert h1 == hash_block_tokens(None, tuple(tokens))
    assert isinstance(h1, bytes) and len(h1) == 32
    # Same tokens under a different parent: a different block.
    h2 = hash_block_tokens(h1, tokens)
    assert h2 != h1
    assert hash_block_tokens(h2, tokens) != h2
    assert hash_block_tokens(None, tokens[:-1] + [99]) != h1


def test_hash_extra_keys():
    tokens = [1, 2, 3, 4]
    plain = hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tokens, ("lora-a",)) != plain
    assert hash_block_tokens(None, tokens, ("lora-a",)) == hash_block_tokens(
        None, tokens, ("lora-a",)
    )
    assert hash_block_tokens(None, tokens, ("lora-a",)) != hash_block_tokens(
        None, tokens, ("lora-b",)
    )


def test_update_request_block_hashes_is_incremental():
    request = Request("r", list(range(40)), SamplingParams(max_tokens=30))
    assert update_request_block_hashes(request, 16) == 2
    first_two = list(request.block_hashes)
    assert first_two[0] == hash_block_tokens(None, list(range(16)))
    assert first_two[1] == hash_block_tokens(first_two[0], list(range(16, 32)))
    assert update_request_block_hashes(request, 16) == 0
    request.append_output_token_ids(list(range(100, 107)))  # 47 tokens: still 2 full
    assert update_request_block_hashes(request, 16) == 0
    request.append_output_token_ids(500)  # 48 tokens: the third block is full
    assert update_request_block_hashes(request, 16) == 1
    assert request.block_hashes[:2] == first_two
    expected = hash_block_tokens(first_two[1], request.all_token_ids[32:48])
    assert request.block_hashes[2] == expected


def test_cache_salt_enters_the_first_block_and_chains():
    """Same tokens, different salts: no block hash in common (a salted request can never hit
    another namespace's prefix); same salt: identical hashes."""

    def hashes(salt):
        request = Request("r", list(range(48)), SamplingParams(), cache_salt=salt)
        update_request_block_hashes(request, 16)
        return request.block_hashes

    assert hashes(None)[0] == hash_block_tokens(None, list(range(16)))
    assert hashes("a")[0] == hash_block_tokens(None, list(range(16)), ("a",))
    assert hashes("a")[1] == hash_block_tokens(hashes("a")[0], list(range(16, 32)))
    assert not set(hashes("a")) & set(hashes("b"))
    assert not set(hashes("a")) & set(hashes(None))
    assert hashes("a") == hashes("a")
