"""Faulting the CPU KV cache's pages in while the engine has nothing to do.

The CPU KV cache is an anonymous mapping that the OS fills lazily (`attention/layer.py`
`_zeros`): start-up stays at seconds, but the first write into each fresh page faults it in,
inside the step that writes it. That fault is slow on a virtual machine whose memory the host
also backs lazily: ~1 GB/s on the AMX machine of BENCHMARKS.md (a 2 MB page ~2 ms), i.e. an
8,192-token prefill spent ~190 ms of its ~2.4 s faulting in its 189 MB of K/V, and a fresh
engine pays that on every token until its blocks have all been used once. vLLM zeroes its
whole cache at start-up instead (minutes there, with the rest of its start-up).

`KVPrefaulter` does that work when it costs nothing: the engine core calls `step` (through
`Worker.idle_work`, once the weights' move onto huge pages is done) while it waits for
requests, one 2 MB piece of one cache tensor a call, so a request that arrives waits for at
most one piece. It walks the blocks in the order the block pool hands them out (lowest ids
first; every layer's K and V of a block range before the next range), so the first requests
find their blocks ready. The pages are populated with madvise(MADV_POPULATE_WRITE): faulted
in writable without being written, so a block already in use keeps its contents. Without that
call (Linux < 5.14, other OSes) there is nothing to do. An idle engine thus commits its whole
KV cache over time, as vLLM's does at start-up; `PAGEDLLM_KV_PREFAULT=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pagedllm.config import env_flag

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14+
PIECE_BYTES = 2 << 20  # a transparent huge page: the unit a fault fills anyway
PAGE_BYTES = 4096


@functools.cache
def _madvise():
    """libc's madvise(addr, length, advice) -> int, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # a ctypes call releases the GIL while it runs


class KVPrefaulter:
    """Populates the pages of paged KV tensors `[2, num_blocks, ...]` (contiguous, on the CPU)
    a piece per `step`, block range by block range in block-id order. `block_dim`: the
    backend's block axis (`kv_block_dim`); caches of another layout are left alone."""

    def __init__(self, caches: list[torch.Tensor], block_dim: int = 1) -> None:
        # One span per K or V half: (address, bytes per block).
        self._spans: list[tuple[int, int]] = []
        self._num_blocks = 0
        for cache in caches if block_dim == 1 else []:
            if cache.device.type != "cpu" or not cache.is_contiguous() or cache.dim() < 2:
                continue
            num_blocks = cache.shape[1]
            block_bytes = cache[0, 0].numel() * cache.element_size()
            for half in range(cache.shape[0]):
                self._spans.append((cache[half].data_ptr(), block_bytes))
            self._num_blocks = max(self._num_blocks, num_blocks)
        # Blocks a piece covers in the largest span (smaller spans' pieces are smaller).
        largest = max((b for _, b in self._spans), default=1)
        self._range_blocks = max(1, PIECE_BYTES // largest)
        self._next_block = 0  # block ranges below it are done
        self._next_span = 0  # in the current range, spans below it are done
        if not self._spans or _madvise() is None or not env_flag("PAGEDLLM_KV_PREFAULT", True):
            self._next_block = self._num_blocks

    @property
    def pending(self) -> bool:
        return self._next_block < self._num_blocks

    @property
    def populated_blocks(self) -> int:
        """Blocks whose pages are populated in every span."""
        return self._next_block

    def step(self) -> bool:
        """Populate the next piece; whether any remain after it."""
        if not self.pending:
            return False
        b0 = self._next_block
        b1 = min(self._num_blocks, b0 + self._range_blocks)
        address, block_bytes = self._spans[self._next_span]
        start = (address + b0 * block_bytes) // PAGE_BYTES * PAGE_BYTES
        end = address + b1 * block_bytes
        if end > start and _madvise()(start, end - start, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            logger.debug("KV prefault stopped: madvise failed (errno %d)", err)
            self._next_block = self._num_blocks  # EINVAL: a kernel without it; give up
            return False
        self._next_span += 1
        if self._next_span == len(self._spans):
            self._next_span = 0
            self._next_block = b1
        return self.pending
