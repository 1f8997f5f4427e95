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
4 KB pages 0.1 s both times), 0.3-0.8 s of `LLM(...)` on a fresh VM and little after;
`PAGEDLLM_WEIGHT_HUGE_PAGES=0` keeps the weights where PyTorch put them.
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


def place_panels_on_huge_pages(model: nn.Module) -> int:
    """Move every packed weight (`weight_panels` buffers, layers/cpu_gemm.py) of `model` on the
    CPU into one mapping on huge pages, each at a 4 KB boundary, in module order (the order a
    forward streams them). The old copies are freed and their heap pages given back to the OS
    (malloc_trim), so the weights are not held twice. Returns the bytes moved."""
    # buffer id -> (the buffer, the modules holding it): a buffer shared by modules moves once
    panels: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}
    for module in model.modules():
        buf = module._buffers.get("weight_panels")
        if isinstance(buf, torch.Tensor) and buf.device.type == "cpu":
            panels.setdefault(id(buf), (buf, []))[1].append(module)
    if not panels:
        return 0

    def span(t: torch.Tensor) -> int:  # each buffer at a 4 KB boundary
        return (t.nbytes + 4095) // 4096 * 4096

    arena = anonymous_bytes(sum(span(buf) for buf, _ in panels.values()), align=HUGE_PAGE)
    offset = 0
    for buf, modules in panels.values():
        moved = arena[offset : offset + buf.nbytes].view(buf.dtype).view(buf.shape)
        moved.copy_(buf)
        for module in modules:
            module._buffers["weight_panels"] = moved
        offset += span(buf)
    del panels, buf  # the old copies, freed before the heap is trimmed
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the freed copies stay with the allocator
        pass
    return offset
