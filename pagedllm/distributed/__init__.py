"""Process groups and collectives for tensor and pipeline parallelism."""

from pagedllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed,
    get_pp_group,
    get_tp_group,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
    single_process_groups,
    tp_all_gather,
    tp_all_reduce,
    tp_gather,
)

__all__ = [
    "GroupCoordinator",
    "destroy_distributed",
    "get_pp_group",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "init_distributed",
    "single_process_groups",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_gather",
]
