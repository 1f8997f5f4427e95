"""Process groups: who am I inside my tensor-parallel and my pipeline-parallel group, and their
collectives.

A process runs single-device (groups of one, collectives are the identity) until
`init_distributed` joins it to a `torch.distributed` world. Ranks are laid out tensor-parallel
first: with `tp` ranks per stage, global ranks `[s * tp, (s + 1) * tp)` form the tensor-parallel
group of pipeline stage `s`, and ranks `r, r + tp, r + 2 * tp, ...` form the pipeline group
that carries tensor-parallel rank `r`'s activations from stage to stage.

On the CPU, a group whose ranks all run on one host talks through shared memory
(`communicator.ShmCommunicator`); otherwise through torch.distributed (gloo on the CPU, NCCL on
CUDA). Pipeline stages pass activations point to point (`send_tensors` / `recv_tensors`).

The one piece of process-wide state is `_GROUPS`, set by `init_distributed` and cleared by
`destroy_distributed` (or swapped for a block by `single_process_groups`); layers read it while
they are built (to create only their own shard) and during forward (to reduce / gather).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.distributed.communicator import ShmCommunicator, shm_collectives_supported

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One process's view of one process group (vLLM's name).

    `ranks` are the members' global ranks in group order; `group` is None for a group of one
    (every collective is then the identity); `shm` is the shared-memory fast path when every
    member is on this host and the device is the CPU.
    """

    ranks: list[int] = field(default_factory=lambda: [0])
    rank_in_group: int = 0
    group: Any = None  # torch.distributed.ProcessGroup | None
    shm: ShmCommunicator | None = None
    # Point-to-point sends still in flight (kept alive until done; see send_tensors).
    _pending_sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """Alias of `rank_in_group` (the tensor-parallel rank, for the layers)."""
        return self.rank_in_group

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    # ---- collectives ---------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group (in place when distributed); returns the summed tensor."""
        if self.world_size == 1:
            return x
        if self.shm is not None and x.is_contiguous():
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        if self._shm_gathers(x, dim):
            return self.shm.gather(x, dst=None)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on group rank `dst`; None elsewhere."""
        if self.world_size == 1:
            return x
        if self._shm_gathers(x, dim):
            return self.shm.gather(x, dst=dst)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if dst == self.rank else None
        dist.gather(x, parts, dst=self.ranks[dst], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def _shm_gathers(self, x: torch.Tensor, dim: int) -> bool:
        return (
            self.shm is not None
            and x.dim() == 2
            and dim in (-1, 1)
            and x.shape[-1] * x.element_size() <= self.shm.slot_bytes
        )

    # ---- point to point (pipeline stages) ------------------------------------------------

    def send_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Send `tensors` to the next rank of the group without waiting for it to receive
        (so a stage can start its next batch); the previous call's sends are completed first,
        which bounds what is in flight to one batch."""
        self.wait_sends()
        dst = self.ranks[self.rank_in_group + 1]
        for t in tensors:
            t = t.contiguous()
            self._pending_sends.append((dist.isend(t, dst=dst, group=self.group), t))

    def recv_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Receive into `tensors` (preallocated with the sender's shapes and dtypes) from the
        previous rank of the group; returns them."""
        src = self.ranks[self.rank_in_group - 1]
        for t in tensors:
            dist.recv(t, src=src, group=self.group)
        return tensors

    def wait_sends(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None


class _GroupHolder:
    """Holds this process's groups; replaced only by the functions below."""

    def __init__(self) -> None:
        self.tp = GroupCoordinator()
        self.pp = GroupCoordinator()


_GROUPS = _GroupHolder()


def group_layout(
    world_size: int, tensor_parallel_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(tensor-parallel groups, pipeline-parallel groups) as lists of global ranks."""
    tp = tensor_parallel_size
    pp = world_size // tp
    tp_groups = [list(range(s * tp, (s + 1) * tp)) for s in range(pp)]
    pp_groups = [list(range(r, world_size, tp)) for r in range(tp)]
    return tp_groups, pp_groups


def init_distributed(
    world_size: int,
    rank: int,
    *,
    tensor_parallel_size: int | None = None,
    distributed_init_method: str = "env://",
    backend: str | None = None,
    node_id: str = "",
    timeout_s: float = 600.0,
) -> GroupCoordinator:
    """Join the `torch.distributed` world (if it is not joined yet) and build the tensor- and
    pipeline-parallel groups; returns the tensor-parallel one. `backend` defaults to NCCL on
    CUDA machines and gloo elsewhere. `node_id` names the host a rank runs on (ranks of a
    group that all share it talk through shared memory on the CPU).

    Every rank must call this with the same `world_size` and `tensor_parallel_size`.
    """
    tp = tensor_parallel_size or world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if tp < 1 or world_size % tp != 0:
        raise ValueError(
            f"tensor_parallel_size={tp} must be >= 1 and divide world_size={world_size}"
        )
    if world_size == 1:
        _GROUPS.tp, _GROUPS.pp = GroupCoordinator(), GroupCoordinator()
        return _GROUPS.tp
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=timedelta(seconds=timeout_s),
        )
    node_ids: list[Any] = [None] * world_size
    dist.all_gather_object(node_ids, node_id)
    use_shm = dist.get_backend() == "gloo" and shm_collectives_supported()
    tp_groups, pp_groups = group_layout(world_size, tp)
    _GROUPS.tp = _make_group(tp_groups, rank, node_ids, use_shm)
    _GROUPS.pp = _make_group(pp_groups, rank, node_ids, use_shm=False)
    return _GROUPS.tp


def _make_group(
    all_ranks: list[list[int]], rank: int, node_ids: list[Any], use_shm: bool
) -> GroupCoordinator:
    """Create every group of a layout (new_group is collective: every rank creates every
    group) and return this rank's, with a shared-memory communicator where it can have one."""
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = GroupCoordinator(ranks=ranks, rank_in_group=ranks.index(rank), group=group)
    assert mine is not None
    if mine.world_size > 1 and use_shm and len({node_ids[r] for r in mine.ranks}) == 1:
        # The first member creates the segment and tells the others its name.
        name = [None]
        if mine.is_first_rank:
            mine.shm = ShmCommunicator(0, mine.world_size)
            name = [mine.shm.name]
        dist.broadcast_object_list(name, src=mine.ranks[0], group=mine.group)
        if not mine.is_first_rank:
            mine.shm = ShmCommunicator(mine.rank_in_group, mine.world_size, name=name[0])
        dist.barrier(group=mine.group)  # every member attached before anyone may unlink
    return mine


def destroy_distributed() -> None:
    """Leave the `torch.distributed` world and fall back to single-device state."""
    for group in (_GROUPS.tp, _GROUPS.pp):
        group.destroy()
    _GROUPS.tp, _GROUPS.pp = GroupCoordinator(), GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process_groups() -> Iterator[None]:
    """Build (and run) modules as if this process were alone: inside the block every group
    has one member. Used for what one rank keeps whole (a speculative-decoding drafter)."""
    saved = _GROUPS.tp, _GROUPS.pp
    _GROUPS.tp, _GROUPS.pp = GroupCoordinator(), GroupCoordinator()
    try:
        yield
    finally:
        _GROUPS.tp, _GROUPS.pp = saved


def get_tp_group() -> GroupCoordinator:
    return _GROUPS.tp


def get_pp_group() -> GroupCoordinator:
    return _GROUPS.pp


def get_tp_world_size() -> int:
    return _GROUPS.tp.world_size


def get_tp_rank() -> int:
    return _GROUPS.tp.rank_in_group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _GROUPS.tp.all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _GROUPS.tp.all_gather(x, dim)


def tp_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """Gather to tensor-parallel rank `dst` (None on the other ranks)."""
    return _GROUPS.tp.gather(x, dst, dim)
