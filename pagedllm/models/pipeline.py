"""Pipeline-parallel structure shared by every model: which layers a stage owns, placeholders
for what it does not, and the activations one stage hands the next.

Stage s of P owns decoder layers `[start, end)` (`get_pp_stage`): an even split (the first
`num_layers % P` stages take one more), or the partition given by
`ParallelConfig.pp_layer_partition` (env `PAGEDLLM_PP_LAYER_PARTITION`, e.g. "5,7"). The first
stage also owns the token embedding, the last the final norm and the LM head; every module a
stage does not own is a `PPMissingLayer` (no parameters), so module names, and with them
checkpoint names, stay those of the whole model. With one stage, a model is exactly the
single-device model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.config import PP_LAYER_PARTITION_ENV
from pagedllm.distributed import get_pp_group


@dataclass(frozen=True)
class PPStage:
    """The decoder layers `[start, end)` this process owns, and its place in the pipeline."""

    start: int
    end: int
    is_first: bool
    is_last: bool


def pp_partition(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[int]:
    """Layers per stage: `partition` when given (checked: one positive count per stage,
    summing to `num_layers`), else an even split, the first `num_layers % pp_size` stages
    taking one more. ValueError names the env var / field."""
    if partition is None:
        if num_layers < pp_size:
            raise ValueError(
                f"pipeline_parallel_size={pp_size} is larger than the model's "
                f"num_hidden_layers={num_layers}: every stage needs a layer"
            )
        base, extra = divmod(num_layers, pp_size)
        return [base + (s < extra) for s in range(pp_size)]
    if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"{PP_LAYER_PARTITION_ENV}={','.join(map(str, partition))} must give "
            f"pipeline_parallel_size={pp_size} positive layer counts summing to "
            f"num_hidden_layers={num_layers}"
        )
    return list(partition)


def get_pp_stage(num_layers: int, partition: list[int] | None = None) -> PPStage:
    """This process's stage, from its pipeline-parallel group (see the module docstring)."""
    pp = get_pp_group()
    counts = pp_partition(num_layers, pp.world_size, partition if pp.world_size > 1 else None)
    start = sum(counts[: pp.rank_in_group])
    return PPStage(
        start=start,
        end=start + counts[pp.rank_in_group],
        is_first=pp.is_first_rank,
        is_last=pp.is_last_rank,
    )


class PPMissingLayer(nn.Identity):
    """Stands where a module of another pipeline stage would be (no parameters)."""


def make_layers(
    num_layers: int, stage: PPStage, layer_fn: Callable[[int], nn.Module]
) -> nn.ModuleList:
    """`num_layers` modules: `layer_fn(i)` for the stage's layers, placeholders elsewhere (so
    layer i keeps its name `layers.i`)."""
    return nn.ModuleList(
        layer_fn(i) if stage.start <= i < stage.end else PPMissingLayer() for i in range(num_layers)
    )


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Dotted names (with a trailing dot) of the model's placeholders: checkpoint tensors under
    them belong to other stages."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))


class IntermediateTensors(dict):
    """Activations a stage hands the next (for the Llama family: "hidden_states" and
    "residual", each [T, hidden]); the keys are the model's."""

    def tensors(self) -> list[torch.Tensor]:
        """The values in a fixed (sorted key) order, the order they travel in."""
        return [self[k] for k in sorted(self)]
