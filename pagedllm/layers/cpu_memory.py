"""CPU memory the OS hands out lazily and, where the kernel offers them, in transparent huge
pages: the paged KV cache (attention/layer.py) and the packed weights of a model.

Why huge pages for the weights: a decode step streams every weight once from memory, and on
the default 4 KB pages that stream crosses a page boundary every 4 KB (a TLB miss, and the
hardware prefetchers stop at the boundary). With the kernel's THP mode "madvise" (common on
servers and VMs, and this project's machines) only memory that asks gets 2 MB pages. The 120
SmolLM2 projections of a batch-1 step streamed at 19.5 GB/s from 4 KB pages and 22.6 GB/s from
2 MB pages (1.18x; 1.07x at 64 rows; BENCHMARKS.md, Zen 4). The move costs start-up time on
a virtual machine whose host backs guest memory lazily: the first touch of 2 MB pages the
guest has never used is slow (270 MB populated in 0.6 s the first time, 0.03 s the next; on
4 KB pages 0.1 s both times): 0.3-0.8 s that `LLM(...)` waited for on a fresh VM, now done
while the engine is idle (`HugePageMove`); `PAGEDLLM_WEIGHT_HUGE_PAGES=0` keeps the weights
where PyTorch put them.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import torch
from torch import nn

HUGE_PAGE = 2 << 20


def anonymous_bytes(nbytes: int, align: int = 4096) -> torch.Tensor:
    """A uint8 tensor of `nbytes` zero bytes in a private anonymous mapping whose start is
    `align`-aligned (a multiple of the page size; HUGE_PAGE for memory meant to sit on huge
    pages from its first byte). Fresh pages read as zero and are committed when first written;
    the mapping asks for transparent huge pages (MADV_HUGEPAGE) where the kernel has them."""
    region = mmap.mmap(
        -1, nbytes + align - mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: 4 KB pages
            pass
    buf = torch.from_numpy(np.frombuffer(region, dtype=np.uint8))  # keeps the mapping alive
    start = -buf.data_ptr() % align
    return buf[start : start + nbytes]


class HugePageMove:
    """Moves every packed weight (`weight_panels` buffers, layers/cpu_gemm.py) of `model` on
    the CPU into one mapping on huge pages, each at a 4 KB boundary, in module order (the order
    a forward streams them), a piece of work per `step`: first the mapping's 2 MB pages are
    faulted in, one a step (the slow part on a VM whose host backs memory lazily), then the
    buffers are copied over, one a step. A buffer keeps its tensor object (`set_`), so every
    holder (its modules, a fused layer's plan) reads the new copy; a buffer shared by modules
    moves once. After the last one the old copies' heap pages go back to the OS (malloc_trim),
    so the weights are not held twice. The engine core process runs the steps while it waits
    for requests (worker `idle_work`), so `LLM(...)` does not wait for them; in between, the
    model runs on the weights where they are, with the same results."""

    def __init__(self, model: nn.Module) -> None:
        seen: set[int] = set()
        self._buffers: list[torch.Tensor] = []
        for module in model.modules():
            buf = module._buffers.get("weight_panels")
            if isinstance(buf, torch.Tensor) and buf.device.type == "cpu" and id(buf) not in seen:
                seen.add(id(buf))
                self._buffers.append(buf)
        self._offsets: list[int] = []
        self.nbytes = 0
        for buf in self._buffers:
            self._offsets.append(self.nbytes)
            self.nbytes += (buf.nbytes + 4095) // 4096 * 4096
        self._arena = anonymous_bytes(self.nbytes, align=HUGE_PAGE) if self._buffers else None
        self._faulted = 0  # bytes of the arena faulted in
        self._moved = 0  # buffers copied over

    def step(self) -> bool:
        """One piece of the move; whether any remain."""
        if self._arena is None:
            return False
        if self._faulted < self.nbytes:
            self._arena[self._faulted : self._faulted + HUGE_PAGE].zero_()
            self._faulted += HUGE_PAGE
            return True
        i = self._moved
        buf, offset = self._buffers[i], self._offsets[i]
        moved = self._arena[offset : offset + buf.nbytes].view(buf.dtype).view(buf.shape)
        moved.copy_(buf)
        with torch.no_grad():
            buf.set_(moved)
        self._moved += 1
        if self._moved < len(self._buffers):
            return True
        self._buffers.clear()
        self._arena = None  # the buffers keep the mapping alive
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: the freed copies stay with the allocator
            pass
        return False

    def finish(self) -> int:
        """Run the remaining steps; returns the bytes of the mapping."""
        while self.step():
            pass
        return self.nbytes


def place_panels_on_huge_pages(model: nn.Module) -> int:
    """`HugePageMove(model)` done at once; returns the bytes moved (0: nothing packed)."""
    return HugePageMove(model).finish()
