"""Process groups and collectives for tensor parallelism."""

from pagedllm.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_distributed,
    get_tp_group,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "TensorParallelGroup",
    "destroy_distributed",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "init_distributed",
    "tp_all_gather",
    "tp_all_reduce",
]
