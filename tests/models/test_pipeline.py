"""Pipeline stages: how layers are split, and what a stage builds."""

from __future__ import annotations

import pytest
from torch import nn

from pagedllm.models.pipeline import (
    PPMissingLayer,
    PPStage,
    make_layers,
    missing_prefixes,
    pp_partition,
)


@pytest.mark.parametrize(
    "layers, stages, partition, expected",
    [
        (12, 2, None, [6, 6]),
        (12, 5, None, [3, 3, 2, 2, 2]),  # the first stages take the remainder
        (2, 2, None, [1, 1]),
        (12, 2, [5, 7], [5, 7]),
    ],
)
def test_partition(layers, stages, partition, expected):
    assert pp_partition(layers, stages, partition) == expected


@pytest.mark.parametrize("partition", [[6, 5], [12, 0], [4, 4, 4]])
def test_bad_partition_names_the_variable(partition):
    with pytest.raises(ValueError, match="PAGEDLLM_PP_LAYER_PARTITION"):
        pp_partition(12, 2, partition)


def test_a_stage_builds_only_its_layers():
    model = nn.Module()
    stage = PPStage(start=1, end=3, is_first=False, is_last=False)
    model.layers = make_layers(4, stage, lambda i: nn.Linear(2, 2))
    model.embed = PPMissingLayer()
    assert [type(m) for m in model.layers] == [PPMissingLayer, nn.Linear, nn.Linear, PPMissingLayer]
    assert set(missing_prefixes(model)) == {"layers.0.", "layers.3.", "embed."}
    assert [n for n, _ in model.named_parameters()] == [
        "layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias",
    ]  # fmt: skip
