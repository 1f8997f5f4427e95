"""The shared-memory all-reduce and gather: three processes get the sum (bit-identical on
every rank) and the rank-ordered concatenation, also for tensors larger than a slot."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.communicator import ShmCommunicator, shm_collectives_supported

WORLD = 3
SLOT = 4096  # bytes: small, so the larger tensors below go through in chunks

pytestmark = pytest.mark.skipif(not shm_collectives_supported(), reason="x86-64 only")


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {
        "vec_bf16": torch.randn(1, 768, generator=g).to(torch.bfloat16),
        "big_fp32": torch.randn(37, 100, generator=g),  # 14.8 KB: four chunks
        "logits": torch.randn(5, 300, generator=g),  # gather: 1.2 KB rows, 3 per chunk
        "empty": torch.randn(0, 64, generator=g),
    }


def _member(rank: int, name: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    comm = ShmCommunicator(rank, WORLD, name=name, slot_bytes=SLOT)
    x = _inputs(rank)
    results = {
        "vec_bf16": comm.all_reduce(x["vec_bf16"].clone()),
        "big_fp32": comm.all_reduce(x["big_fp32"].clone()),
        "empty": comm.all_reduce(x["empty"].clone()),
        "gather_to_1": comm.gather(x["logits"], dst=1),
        "all_gather": comm.gather(x["logits"], dst=None),
    }
    comm.close()
    torch.save(results, f"{out_dir}/{rank}.pt")


@pytest.mark.distributed
def test_all_reduce_and_gather_across_processes(tmp_path, worker_mp_context):
    owner = ShmCommunicator(0, WORLD, slot_bytes=SLOT)
    ctx = worker_mp_context
    procs = [ctx.Process(target=_member, args=(r, owner.name, str(tmp_path))) for r in (1, 2)]
    for p in procs:
        p.start()
    x = _inputs(0)
    mine = {
        "vec_bf16": owner.all_reduce(x["vec_bf16"].clone()),
        "big_fp32": owner.all_reduce(x["big_fp32"].clone()),
        "empty": owner.all_reduce(x["empty"].clone()),
        "gather_to_1": owner.gather(x["logits"], dst=1),
        "all_gather": owner.gather(x["logits"], dst=None),
    }
    for p in procs:
        p.join(120)
    owner.close()
    assert [p.exitcode for p in procs] == [0, 0]
    others = [torch.load(tmp_path / f"{r}.pt") for r in (1, 2)]
    inputs = [_inputs(r) for r in range(WORLD)]
    for key in ("vec_bf16", "big_fp32"):
        expected = sum(i[key].float() for i in inputs)
        torch.testing.assert_close(mine[key].float(), expected, rtol=2e-2, atol=2e-2)
        for o in others:  # every rank holds exactly the same sum
            assert torch.equal(o[key], mine[key])
    assert mine["empty"].shape == (0, 64)
    concat = torch.cat([i["logits"] for i in inputs], dim=-1)
    assert mine["gather_to_1"] is None and others[1]["gather_to_1"] is None
    assert torch.equal(others[0]["gather_to_1"], concat)
    for result in (mine, *others):
        assert torch.equal(result["all_gather"], concat)


def test_owner_unlinks_segment():
    comm = ShmCommunicator(0, 2, slot_bytes=SLOT)
    name = comm.name
    comm.close()
    with pytest.raises(FileNotFoundError):
        ShmCommunicator(1, 2, name=name, slot_bytes=SLOT)
