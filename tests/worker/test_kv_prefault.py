"""The idle engine's KV prefault (worker/kv_prefault.py): it faults a lazily zeroed CPU KV
cache's pages in, in block order, without changing what blocks in use hold; and an engine
core left idle does it on its own."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import pytest
import torch

from pagedllm.attention.layer import _zeros
from pagedllm.worker.kv_prefault import PAGE_BYTES, KVPrefaulter, _madvise

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's"
)


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) 4 KB pages of `t`'s memory, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() // PAGE_BYTES * PAGE_BYTES
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - start) // PAGE_BYTES)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), pages


def kv_cache(num_blocks: int) -> torch.Tensor:
    # [2, num_blocks, block_size 16, 2 heads, 64] bf16: 4 KB a block per half
    return _zeros((2, num_blocks, 16, 2, 64), torch.bfloat16, torch.device("cpu"))


def populate_supported() -> bool:
    probe = kv_cache(1)
    return _madvise() is not None and KVPrefaulter([probe]).pending


def test_prefault_populates_every_page_in_block_order_and_keeps_contents():
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    caches = [kv_cache(3000), kv_cache(3000)]  # 2 layers, ~23.4 MB each
    # Blocks already written (in use) before the prefault reaches them; the rest untouched
    # (not even read: a read maps the shared zero page, which mincore counts as resident).
    caches[0][0, 2000].fill_(1.5)
    caches[1][1, 2999].fill_(-2.0)
    assert resident_pages(caches[0])[0] < resident_pages(caches[0])[1] // 2
    pre = KVPrefaulter(caches)
    # A piece is a 2 MB page's worth of blocks of one K or V half; four halves a range.
    assert pre._range_blocks == (2 << 20) // 4096
    done, steps = [], 0
    while pre.step():
        steps += 1
        done.append(pre.populated_blocks)
    steps += 1
    ranges = -(-3000 // pre._range_blocks)
    assert steps == 4 * ranges and not pre.pending
    assert done == sorted(done) and pre.populated_blocks == 3000
    for c in caches:
        resident, total = resident_pages(c)
        assert resident == total
    # Populated, not written: the blocks in use kept their values, the others read zero.
    expected = [torch.zeros_like(c) for c in caches]
    expected[0][0, 2000] = 1.5
    expected[1][1, 2999] = -2.0
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))
    assert not pre.step()
    assert not KVPrefaulter([kv_cache(64)], block_dim=0).pending  # a layout it does not know


def test_prefault_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "0")
    pre = KVPrefaulter([kv_cache(64)])
    assert not pre.pending and not pre.step()
    assert not KVPrefaulter([]).pending  # no CPU cache: nothing to do


def engine_rss_mib(front_pid: int) -> float:
    """Resident memory of `front_pid`'s child processes (the engine core), MiB."""
    total = 0
    for child in open(f"/proc/{front_pid}/task/{front_pid}/children").read().split():
        status = open(f"/proc/{child}/status").read()
        total += int(status.split("VmRSS:")[1].split()[0])
    return total / 1024


@pytest.mark.parametrize("prefault", ["1", "0"])
def test_an_idle_engine_faults_its_kv_cache_in(tiny_llama_dir, monkeypatch, prefault):
    """An engine core left idle after start-up commits its 512 MiB KV cache (with prefault
    off, it stays uncommitted), and then serves as before."""
    if prefault == "1" and not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", prefault)
    llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory=512 << 20)
    try:
        start = engine_rss_mib(os.getpid())
        deadline = time.monotonic() + 60
        while prefault == "1" and engine_rss_mib(os.getpid()) < start + 400:
            assert time.monotonic() < deadline, "the idle engine did not fault its cache in"
            time.sleep(0.2)
        if prefault == "0":
            time.sleep(1.0)
            assert engine_rss_mib(os.getpid()) < start + 200
        out = llm.generate(["hello there"], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
