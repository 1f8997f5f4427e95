"""Tensor-parallel group state: who am I inside my tensor-parallel group, and its collectives.

A process runs single-device (world size 1, rank 0, collectives are the identity) until
`init_distributed` joins it to a `torch.distributed` world. Ranks are laid out tensor-parallel
first: with `tensor_parallel_size = tp`, global ranks `[s * tp, (s + 1) * tp)` form the tensor
parallel group of pipeline stage `s`.

The one piece of process-wide state is `_GROUPS`, a holder set by `init_distributed` and cleared
by `destroy_distributed`; layers read it while they are built (to create only their own shard)
and during forward (to reduce / gather partial results).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """One process's view of its tensor-parallel group.

    `group` is None when the group has a single member; every collective is then the identity.
    """

    world_size: int = 1
    rank: int = 0
    group: Any = None  # torch.distributed.ProcessGroup | None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group (in place when distributed); returns the summed tensor."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class _GroupHolder:
    """Holds this process's tensor-parallel group; replaced only by init/destroy below."""

    def __init__(self) -> None:
        self.tp: TensorParallelGroup = TensorParallelGroup()


_GROUPS = _GroupHolder()


def init_distributed(
    world_size: int,
    rank: int,
    *,
    tensor_parallel_size: int | None = None,
    distributed_init_method: str = "env://",
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> TensorParallelGroup:
    """Join the `torch.distributed` world (if it is not joined yet) and build the tensor
    parallel groups. `backend` defaults to NCCL on CUDA machines and gloo elsewhere.

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
        _GROUPS.tp = TensorParallelGroup()
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
    my_group = None
    # new_group is collective: every rank creates every group, keeps its own.
    for start in range(0, world_size, tp):
        ranks = list(range(start, start + tp))
        group = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            my_group = group
    _GROUPS.tp = TensorParallelGroup(world_size=tp, rank=rank % tp, group=my_group)
    return _GROUPS.tp


def destroy_distributed() -> None:
    """Leave the `torch.distributed` world and fall back to single-device state."""
    _GROUPS.tp = TensorParallelGroup()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> TensorParallelGroup:
    return _GROUPS.tp


def get_tp_world_size() -> int:
    return _GROUPS.tp.world_size


def get_tp_rank() -> int:
    return _GROUPS.tp.rank


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _GROUPS.tp.all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _GROUPS.tp.all_gather(x, dim)
