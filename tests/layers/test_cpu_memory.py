"""Lazily committed CPU memory on huge pages: the KV cache's and the packed weights'."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from pagedllm.layers.cpu_memory import (
    HUGE_PAGE,
    HugePageMove,
    anonymous_bytes,
    place_panels_on_huge_pages,
)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (Linux smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_anonymous_bytes_are_zero_aligned_and_writable():
    buf = anonymous_bytes(5 * HUGE_PAGE + 123, align=HUGE_PAGE)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * HUGE_PAGE + 123
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert not buf.any()
    buf[-1] = 7
    assert int(buf[-1]) == 7
    if hasattr(mmap, "MADV_HUGEPAGE") and Path("/proc/self/smaps").exists():
        assert "hg" in _vm_flags(buf.data_ptr())  # asked for transparent huge pages


class _Layer(nn.Module):
    def __init__(self, panels: torch.Tensor):
        super().__init__()
        self.register_buffer("weight_panels", panels, persistent=False)
        self.register_buffer("other", torch.ones(3), persistent=False)


def test_place_panels_moves_every_panel_once_into_one_mapping():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 8, 64, 2, generator=g).bfloat16()
    b = torch.randint(-128, 128, (5, 4, 64, 4), generator=g, dtype=torch.int8)
    shared = torch.randn(2, 16, 64, 2, generator=g).bfloat16()  # a tied head's, two owners
    model = nn.Sequential(_Layer(a.clone()), _Layer(b.clone()), _Layer(shared), _Layer(shared))
    others = [m.other for m in model]
    moved = place_panels_on_huge_pages(model)
    assert moved == sum((t.nbytes + 4095) // 4096 * 4096 for t in (a, b, shared))
    panels = [m.weight_panels for m in model]
    for got, want in zip(panels, (a, b, shared, shared)):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert panels[2] is panels[3]
    ptrs = [p.data_ptr() for p in panels[:3]]
    assert ptrs[0] % HUGE_PAGE == 0 and all(p % 4096 == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < moved  # one arena, in module order
    assert all(m.other is o for m, o in zip(model, others))  # other buffers untouched
    assert place_panels_on_huge_pages(nn.Linear(2, 2)) == 0  # nothing packed: nothing moved


def test_the_move_goes_a_piece_a_step_and_holders_see_the_moved_copy():
    """Faulting in the mapping's 2 MB pages, then one buffer a step; a buffer keeps its tensor
    object, so what held it before (a fused layer's argument tuple) reads the new copy, with
    the same values at every step."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(
        40, 288, 64, 2, generator=g
    ).bfloat16()  # 2.8 MB (a multiple of 4 KB): two huge pages
    small = torch.randint(-128, 128, (2, 4, 64, 4), generator=g, dtype=torch.int8)
    model = nn.Sequential(_Layer(big.clone()), _Layer(small.clone()))
    held = (model[0].weight_panels, model[1].weight_panels)  # captured before the move
    old_ptrs = [t.data_ptr() for t in held]
    move = HugePageMove(model)
    assert move.nbytes == big.nbytes + 4096  # each buffer from a 4 KB boundary
    steps = 0
    while move.step():
        steps += 1
        assert torch.equal(held[0], big) and torch.equal(held[1], small)
    assert steps == 2 + 2 - 1  # two pages faulted in, two buffers copied (the last returns False)
    assert not move.step()  # done: nothing left
    assert all(m.weight_panels is h for m, h in zip(model, held))
    assert torch.equal(held[0], big) and torch.equal(held[1], small)
    new_ptrs = [t.data_ptr() for t in held]
    assert new_ptrs[0] % HUGE_PAGE == 0 and new_ptrs[1] - new_ptrs[0] == move.nbytes - 4096
    assert held[0].untyped_storage().data_ptr() == held[1].untyped_storage().data_ptr()
    assert not set(old_ptrs) & set(new_ptrs)


def test_an_engine_core_moves_its_weights_while_idle_with_the_same_outputs(tiny_llama_dir):
    """The engine core process's idle work moves the packed weights onto huge pages (its
    start does not wait for it); greedy tokens before and after the move are the same."""
    from pagedllm.engine import EngineCoreRequest
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.core import EngineCore
    from pagedllm.sampling_params import SamplingParams

    core = EngineCore(
        EngineArgs(
            model=tiny_llama_dir, dtype="bfloat16", kv_cache_memory=1 << 26
        ).create_engine_config()
    )
    runner = core.executor.worker.model_runner
    panels = [m.weight_panels for m in runner.model.modules() if "weight_panels" in m._buffers]
    if not panels:
        pytest.skip("this CPU keeps no weight in panels")
    assert runner.weight_move is not None  # pending: the load did not wait for it

    def greedy(request_id: str) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=[5, 9, 2, 7],
            sampling_params=params,
            arrival_time=0.0,
        )
        core.add_request(request)
        tokens: list[int] = []
        while core.scheduler.has_unfinished_requests():
            for out in core.step().outputs:
                tokens += out.new_token_ids
        return tokens

    before = greedy("before")
    while runner.weight_move is not None:
        assert core.idle_work()
    assert len({p.untyped_storage().data_ptr() for p in panels}) == 1  # views of one arena
    assert greedy("after") == before
    core.shutdown()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps")
def test_a_loaded_models_panels_share_one_huge_page_mapping(tiny_llama_dir, monkeypatch):
    """An in-process engine (no idle loop) has its packed weights (where this CPU packs
    them) moved into one mapping that asks for huge pages before it serves, and serves from
    them."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", kv_cache_memory=1 << 26)
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    panels = [m.weight_panels for m in model.modules() if "weight_panels" in m._buffers]
    if not panels:
        pytest.skip("this CPU keeps no weight in panels")
    starts = [p.data_ptr() for p in panels]
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert all("hg" in _vm_flags(s) for s in starts)
    base = {p.untyped_storage().data_ptr() for p in panels}
    assert len(base) == 1  # views of one arena
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
