"""The cost of one all-reduce among ranks of this machine: the shared-memory communicator vs
gloo over loopback, for a tensor of `--numel` elements (default: one token's hidden vector of
the ~125M Llama, 768 bf16 values).

    python -m pagedllm.benchmarks.allreduce --world-size 2 --numel 768 --dtype bfloat16

Each rank is pinned to its own core (as the mp executor pins workers); the figure is the median
over `--repeats` blocks of `--iters` back-to-back all-reduces, per all-reduce, taken on rank 0,
the two transports alternating block by block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rank_main(rank: int, args: argparse.Namespace, init_method: str, results) -> None:
    import torch.distributed as dist

    from pagedllm.distributed import destroy_distributed, get_tp_group, init_distributed
    from pagedllm.worker.cpu_binding import bind_threads, plan_cpu_binding

    plan = plan_cpu_binding(args.world_size)
    bind_threads(plan[rank] if plan else None)
    init_distributed(args.world_size, rank, distributed_init_method=init_method, backend="gloo")
    group = get_tp_group()
    x = torch.ones(args.numel, dtype=getattr(torch, args.dtype))

    def shm() -> None:
        group.shm.all_reduce(x)

    def gloo() -> None:
        dist.all_reduce(x, group=group.group)

    timings: dict[str, list[float]] = {"shm": [], "gloo": []}
    for _ in range(args.repeats):
        for name, op in (("shm", shm), ("gloo", gloo)):
            for _ in range(max(args.iters // 10, 1)):  # warm up this transport
                op()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                op()
            timings[name].append((time.perf_counter() - t0) / args.iters * 1e6)
    if rank == 0:
        results.put(timings)
    destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--numel", type=int, default=768)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from pagedllm.executor.multiproc_executor import worker_mp_context
    from pagedllm.spawn import get_open_port

    ctx = worker_mp_context()
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{get_open_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(r, args, init_method, results))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    timings = results.get()
    for p in procs:
        p.join()
    shm, gloo = statistics.median(timings["shm"]), statistics.median(timings["gloo"])
    print(f"all-reduce of {args.numel} {args.dtype} over {args.world_size} ranks (us, per op)")
    print(f"  shared memory: median {shm:.1f}  (blocks: {[round(t, 1) for t in timings['shm']]})")
    print(f"  gloo:          median {gloo:.1f}  (blocks: {[round(t, 1) for t in timings['gloo']]})")
    print(f"  gloo / shared memory: {gloo / shm:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
