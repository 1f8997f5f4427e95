"""PAGEDLLM_CPU_OMP_THREADS_BIND: the cores each local rank is pinned to."""

from __future__ import annotations

import pytest

from pagedllm.worker.cpu_binding import plan_cpu_binding


@pytest.mark.parametrize(
    "world, spec, available, expected",
    [
        (2, "auto", {0, 1}, [{0}, {1}]),  # this machine, TP=2: a core each
        (2, "auto", set(range(8)), [{0, 1, 2, 3}, {4, 5, 6, 7}]),
        (3, "auto", {4, 5, 6, 7, 8, 9, 10}, [{4, 5}, {6, 7}, {8, 9}]),
        (4, "auto", {0, 1}, [{0}, {1}, {0}, {1}]),  # more ranks than cores: round robin
        (2, "nobind", {0, 1}, None),
        (2, "0-2|3,5", set(range(6)), [{0, 1, 2}, {3, 5}]),
    ],
)
def test_plan(world, spec, available, expected):
    assert plan_cpu_binding(world, spec, available) == expected


@pytest.mark.parametrize("spec", ["0-3", "0|x", "0||1", "0|9"])
def test_bad_spec_is_a_value_error(spec):
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_OMP_THREADS_BIND"):
        plan_cpu_binding(2, spec, {0, 1, 2, 3})
