"""Tests for pagedllm.core.kv_cache_manager: prefix hits, allocation, freeing, integrity."""

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import update_request_block_hashes
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_request(req_id: str, prompt: list[int], **params) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=16, **params))
    update_request_block_hashes(request, BLOCK_SIZE)
    return request


def make_manager(num_blocks: int = 10, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len=1024, enable_caching=enable_caching)


def admit(manager: KVCacheManager, request: Request):
    """What the scheduler does on admission: look up, allocate the rest, advance."""
    hits, num_hit = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit, blocks


def test_prefix_hit_of_three_full_blocks():
    manager = make_manager()
    r0 = make_request("r0", list(range(50)))  # 3 full blocks + 2 tokens
    _, num_hit, blocks = admit(manager, r0)
    assert num_hit == 0
    assert len(blocks) == 4
    r1 = make_request("r1", list(range(48)) + [900, 901, 902, 903, 904])
    hits, num_hit = manager.get_computed_blocks(r1)
    assert num_hit == 48
    assert hits.get_block_ids() == manager.get_block_ids("r0")[:3]
    new = manager.allocate_slots(r1, r1.num_tokens - 48, 48, hits)
    assert len(new) == 1  # only the partial fourth block is new
    assert manager.get_block_ids("r1")[:3] == manager.get_block_ids("r0")[:3]
    assert all(b.ref_cnt == 2 for b in hits.blocks)
    manager.check_integrity()


def test_whole_prompt_hit_keeps_the_last_token_computed():
    manager = make_manager()
    r0 = make_request("r0", list(range(48)))
    admit(manager, r0)
    r1 = make_request("r1", list(range(48)))  # identical, exactly 3 full blocks
    hits, num_hit = manager.get_computed_blocks(r1)
    assert num_hit == 32  # the third block is recomputed so the last token yields logits
    assert len(hits) == 2


def test_no_hits_without_caching_or_with_prompt_logprobs():
    manager = make_manager(enable_caching=False)
    r0 = make_request("r0", list(range(40)))
    admit(manager, r0)
    assert manager.get_computed_blocks(make_request("r1", list(range(40))))[1] == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)

    manager = make_manager()
    admit(manager, make_request("r0", list(range(40))))
    wants_logprobs = make_request("r1", list(range(40)), prompt_logprobs=2)
    assert manager.get_computed_blocks(wants_logprobs)[1] == 0
    assert manager.get_computed_blocks(make_request("r2", list(range(40))))[1] == 32


def test_allocation_failure_returns_none_and_changes_nothing():
    manager = make_manager(num_blocks=4)
    r0 = make_request("r0", list(range(40)))  # 3 blocks
    admit(manager, r0)
    r1 = make_request("r1", list(range(1000, 1040)))
    assert manager.allocate_slots(r1, 40) is None
    assert manager.block_pool.get_num_free_blocks() == 1
    assert "r1" not in manager.req_to_blocks
    manager.check_integrity()
    assert manager.allocate_slots(r1, 16) is not None  # one block still fits


def test_decode_growth_allocates_a_block_at_the_boundary_and_caches_it():
    manager = make_manager()
    r0 = make_request("r0", list(range(16)))
    admit(manager, r0)
    assert len(manager.get_block_ids("r0")) == 1
    # Decode: the sampled token is appended, then one new token runs.
    r0.append_output_token_ids(500)
    update_request_block_hashes(r0, BLOCK_SIZE)
    new = manager.allocate_slots(r0, 1)
    assert len(new) == 1 and len(manager.get_block_ids("r0")) == 2
    r0.num_computed_tokens += 1
    for t in range(15):
        r0.append_output_token_ids(600 + t)
        update_request_block_hashes(r0, BLOCK_SIZE)
        assert len(manager.allocate_slots(r0, 1)) == 0
        r0.num_computed_tokens += 1
    # 32 tokens computed: the second block is full and cached.
    second = manager.req_to_blocks["r0"][1]
    assert second.block_hash == r0.block_hashes[1]
    assert manager.num_cached_block["r0"] == 2
    manager.check_integrity()


def test_draft_tokens_get_slots_but_are_never_cached():
    manager = make_manager()
    r0 = make_request("r0", list(range(15)))
    blocks = manager.allocate_slots(r0, 15, num_lookahead_tokens=4)
    assert len(blocks) == 2  # 19 slots
    assert manager.num_cached_block["r0"] == 0  # only 15 known tokens: no full block


def test_hits_on_free_blocks_count_against_free_space():
    manager = make_manager(num_blocks=4)
    r0 = make_request("r0", list(range(48)))
    admit(manager, r0)
    manager.free(r0)
    assert manager.block_pool.get_num_free_blocks() == 4
    r1 = make_request("r1", list(range(48)) + list(range(500, 516)))
    hits, num_hit = manager.get_computed_blocks(r1)
    assert num_hit == 48
    # 64 tokens need 4 blocks; 3 hits are free-but-cached, so 1 new one is needed: fits.
    assert manager.allocate_slots(r1, 16, num_hit, hits) is not None
    assert manager.block_pool.get_num_free_blocks() == 0
    manager.check_integrity()
    # With one more block needed than is free once the hits are taken, it must fail.
    manager.free(r1)
    r2 = make_request("r2", list(range(48)) + list(range(700, 740)))  # 88 tokens: 6 blocks
    hits, num_hit = manager.get_computed_blocks(r2)
    assert num_hit == 48
    assert manager.allocate_slots(r2, 40, num_hit, hits) is None
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    manager.check_integrity()


def test_no_leak_after_all_requests_finish():
    manager = make_manager(num_blocks=20)
    requests = [make_request(f"r{i}", list(range(i * 7, i * 7 + 30 + i))) for i in range(5)]
    for request in requests:
        admit(manager, request)
    manager.check_integrity()
    assert manager.usage > 0
    for request in requests:
        manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 20
    assert manager.usage == 0.0
    assert not manager.req_to_blocks
    manager.check_integrity()
    manager.free(requests[0])  # freeing twice is a no-op


def test_free_returns_tail_blocks_first():
    manager = make_manager(num_blocks=4)
    r0 = make_request("r0", list(range(40)))
    admit(manager, r0)
    block_ids = manager.get_block_ids("r0")
    manager.free(r0)
    queue = manager.block_pool.free_block_queue.get_all_free_blocks()
    assert [b.block_id for b in queue] == [3] + block_ids[::-1]


def test_prefix_cache_stats_and_reset():
    manager = make_manager()
    admit(manager, make_request("r0", list(range(40))))
    manager.get_computed_blocks(make_request("r1", list(range(40))))
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_reset_prefix_cache():
    manager = make_manager()
    r0 = make_request("r0", list(range(40)))
    admit(manager, r0)
    assert not manager.reset_prefix_cache()
    manager.free(r0)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("r1", list(range(40))))[1] == 0


def test_check_integrity_catches_a_bad_ref_count():
    manager = make_manager()
    admit(manager, make_request("r0", list(range(40))))
    manager.req_to_blocks["r0"][0].ref_cnt += 1
    with pytest.raises(AssertionError):
        manager.check_integrity()
