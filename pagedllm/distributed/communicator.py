"""Collectives among the ranks of one group that share a host, through shared memory.

gloo's all-reduce over loopback costs milliseconds on a busy CPU box (TCP, a background thread,
a sleeping wake-up per round trip), far more than the math of a decode step's hidden-size
vector. Ranks on one host instead meet in a shared-memory segment:

    [seq: one int64 per rank, each on its own 64-byte line]
    [buffer 0: one slot of `slot_bytes` per rank][buffer 1: the same]

Op k (k = 1, 2, ...) uses buffer k % 2: every rank copies its chunk into its own slot, stores
`seq[me] = k`, spins until every `seq[j] >= k`, then reads all slots (summing them in rank
order, so every rank computes bit-identical results). Double buffering makes that one barrier
enough: a rank writes buffer k % 2 again only in op k + 2, after op k + 1's barrier, which a
peer reaches only once it has finished reading op k. Tensors larger than a slot go through in
chunks, one op per chunk.

The protocol relies on x86-64's total store order (a rank's data stores are visible before its
`seq` store; its loads of a peer's data follow its load of the peer's `seq`), so
`shm_collectives_supported()` is False elsewhere and the group falls back to torch.distributed.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from multiprocessing import shared_memory

import numpy as np
import torch

# Default per-rank slot: large enough for a decode batch's activations in one op, small enough
# that a segment stays a few MiB; prefill-sized tensors go through in chunks.
DEFAULT_SLOT_BYTES = 4 << 20
_LINE = 64  # bytes per seq entry (a cache line each: no false sharing between ranks)
_SPINS_BEFORE_YIELD = 16  # then sched_yield, so oversubscribed ranks let their peers run
_TIMEOUT_CHECK_EVERY = 4096


def shm_collectives_supported() -> bool:
    """Whether this machine's memory model is the one the protocol assumes (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def attach_shared_memory(name: str) -> tuple[mmap.mmap, object]:
    """Map an existing POSIX shared-memory segment without registering it with this process's
    resource tracker (which would unlink it when this process exits; the creator owns it).
    Returns (buffer, file) to close together."""
    f = open(f"/dev/shm/{name}", "r+b")  # noqa: SIM115 - closed by the caller with the map
    return mmap.mmap(f.fileno(), 0), f


class ShmCommunicator:
    """All-reduce and (all-)gather for `world_size` ranks of one host (see the module
    docstring). One instance per rank; rank 0 creates the segment (`create`), the others
    attach by name. Every rank must call the same ops in the same order with tensors of the
    same shape and dtype (as with any collective)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        name: str | None = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        header = _LINE * world_size
        size = header + 2 * world_size * slot_bytes
        self._owner = name is None
        self._file = None
        if self._owner:
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self.name = self._shm.name
            buf = self._shm.buf
            buf[:header] = bytes(header)
        else:
            self._shm = None
            self.name = name
            buf, self._file = attach_shared_memory(name)
        self._buf = buf
        self._seq = np.ndarray((world_size,), dtype=np.int64, buffer=buf, strides=(_LINE,))
        self._data = torch.frombuffer(buf, dtype=torch.uint8, offset=header, count=size - header)
        self._data = self._data.view(2, world_size, slot_bytes)
        self._op = 0

    # ---- collectives ---------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (`x` must be contiguous); returns `x`."""
        flat = x.view(-1)
        per_chunk = self.slot_bytes // x.element_size()
        for a in range(0, flat.numel(), per_chunk):
            part = flat[a : a + per_chunk]
            slots = self._exchange(part)  # [world, n]
            torch.sum(slots, dim=0, out=part)
        return x

    def gather(self, x: torch.Tensor, dst: int | None = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's 2-D `x` [N, C] along its last dim ([N, C * world]), in rank
        order, on rank `dst` (on every rank when `dst` is None); other ranks get None."""
        assert x.dim() == 2 and dim in (-1, 1), "gather takes [N, C] tensors along dim -1"
        rows, cols = x.shape
        row_bytes = cols * x.element_size()
        if row_bytes > self.slot_bytes:
            raise ValueError(
                f"a row of {row_bytes} bytes does not fit a {self.slot_bytes}-byte slot"
            )
        keep = dst is None or dst == self.rank
        out = x.new_empty(rows, cols * self.world_size) if keep else None
        per_chunk = max(1, self.slot_bytes // row_bytes)
        x = x.contiguous()
        for a in range(0, max(rows, 1), per_chunk):
            part = x[a : a + per_chunk]
            slots = self._exchange(part.reshape(-1))  # [world, n * cols]
            if keep:
                n = part.shape[0]
                out[a : a + n].view(n, self.world_size, cols).copy_(
                    slots.view(self.world_size, n, cols).transpose(0, 1)
                )
        return out

    def _exchange(self, part: torch.Tensor) -> torch.Tensor:
        """One op: publish `part` (1-D), wait for every rank's; returns the slots
        [world, part.numel()] of this op's buffer (valid until the op after next)."""
        self._op += 1
        nbytes = part.numel() * part.element_size()
        buf = self._data[self._op & 1, :, :nbytes].view(part.dtype)  # [world, n]
        buf[self.rank].copy_(part)
        self._seq[self.rank] = self._op
        self._wait_all(self._op)
        return buf

    def _wait_all(self, op: int) -> None:
        seq = self._seq
        spins = 0
        deadline = None
        for j in range(self.world_size):
            while seq[j] < op:
                spins += 1
                if spins > _SPINS_BEFORE_YIELD:
                    os.sched_yield()
                if spins % _TIMEOUT_CHECK_EVERY == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise TimeoutError(
                            f"shared-memory collective: rank {j} of {self.world_size} did not "
                            f"arrive within {self.timeout_s:.0f}s (segment {self.name})"
                        )

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Release the mapping; the creating rank also unlinks the segment."""
        self._seq = None
        self._data = None
        try:
            if self._owner:
                self._buf = None
                self._shm.close()
            else:
                self._buf.close()
                self._file.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last reference
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
