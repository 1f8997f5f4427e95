"""A/B of two versions of pagedllm's native CPU kernels in one process: this checkout's and a
git revision's, alternated round by round on SmolLM2-shaped projections (the 120 products of
`cpu_projections.py`: QKV, O, gate / up with SiLU, down, 30 layers of random bf16 weights).

    python scripts/cpu_ops_ab.py REV [ROWS ...] [--rounds 11] [--attention LOW HIGH]

On shared machines whose speed swings 2-3x from one minute to the next, two processes timed one
after the other compare phases of the machine more than kernels; alternating the two versions
inside one process, a pass each, compares them under the same conditions. REV's `csrc` is
taken with `git show`, its operator library and C++ namespace renamed (`pagedllm_ab`), built
once into pagedllm's cache directory, and loaded next to this checkout's. Both versions must
read the same weight layout (this checkout's `to_panels`); their outputs are compared first
(equal bits expected unless a change means to alter them; the largest difference is printed).
Prints per row count the medians, and the median of the per-round ratios (REV time / this
checkout's time: above 1, this checkout is faster). `--attention LOW HIGH` adds prefill
attention (`paged_prefill_attention`) on 64 prompts of LOW-HIGH tokens; `--decode B LOW HIGH`
decode attention (`paged_decode_attention`) of B requests of LOW-HIGH tokens, over 30 layers'
caches (their K / V from memory, as in a step). `--int8` adds the same products on int8
weights (`linear_int8`, W8A16, as `quantization="int8"` runs them).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops
from pagedllm.ops.build import CFLAGS, build_dir

sys.path.insert(0, str(Path(__file__).parent))
from cpu_projections import INTER, LAYERS, SHAPES  # noqa: E402  (the same 120 products)

REPO = Path(__file__).resolve().parents[1]
CSRC = "pagedllm/ops/csrc"


def build_revision(rev: str) -> str:
    """Build REV's kernels as operator namespace `pagedllm_ab`; returns the namespace."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{sha}:{CSRC}"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    key = hashlib.sha256(f"{' '.join(CFLAGS)} {torch.__version__}".encode()).hexdigest()[:8]
    out = build_dir().parent / f"ab-{sha[:12]}-{key}"
    src = out / "csrc"
    library = out / "pagedllm_ab_ops.so"
    if not library.exists():
        src.mkdir(parents=True, exist_ok=True)
        for name in names:
            text = subprocess.run(["git", "show", f"{sha}:{CSRC}/{name}"], cwd=REPO,
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
            text = text.replace("TORCH_LIBRARY(pagedllm,", "TORCH_LIBRARY(pagedllm_ab,")
            text = text.replace("TORCH_LIBRARY_IMPL(pagedllm,", "TORCH_LIBRARY_IMPL(pagedllm_ab,")
            text = text.replace("namespace pagedllm", "namespace pagedllm_ab")
            text = text.replace("pagedllm::", "pagedllm_ab::")
            (src / name).write_text(text)
        from torch.utils.cpp_extension import load

        load(name="pagedllm_ab_ops", sources=[str(src / "ops.cpp")], extra_cflags=CFLAGS,
             extra_ldflags=["-fopenmp"], extra_include_paths=[str(src)], build_directory=str(out),
             is_python_module=False)  # fmt: skip
    else:
        torch.ops.load_library(str(library))
    return "pagedllm_ab"


HEADS, KV_HEADS, HEAD, BLOCK = 9, 3, 64, 16  # SmolLM2's attention, 16-token cache blocks


def shuffled_blocks(lens: torch.Tensor, g: torch.Generator) -> tuple[int, torch.Tensor]:
    """(cache blocks, block table [requests, most blocks]): each request's blocks for its
    length, in a shuffled order across the cache."""
    blocks = [-(-int(n) // BLOCK) for n in lens]
    ids = torch.randperm(sum(blocks), generator=g).int()
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    for r, start in enumerate(torch.tensor([0] + blocks).cumsum(0)[:-1].tolist()):
        table[r, : blocks[r]] = ids[start : start + blocks[r]]
    return sum(blocks), table


def prefill_attention_case(low: int, high: int):
    """paged_prefill_attention on 64 prompts of low-high tokens (SmolLM2's 9 query / 3 KV
    heads of 64, bf16, blocks of 16 in a shuffled cache): a function of the ops namespace."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(low, high + 1, (64,), generator=g)
    num_blocks, table = shuffled_blocks(lens, g)
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD, generator=g).bfloat16()
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    q = torch.randn(int(qsl[-1]), HEADS, HEAD, generator=g).bfloat16()
    reqs = torch.arange(len(lens))

    def run(ops) -> list[torch.Tensor]:
        out = torch.empty_like(q)
        ops.paged_prefill_attention(q, out, kv, table, lens.int(), qsl, reqs, HEAD**-0.5)
        return [out]

    return run


def decode_attention_case(batch: int, low: int, high: int, layers: int = LAYERS):
    """paged_decode_attention of `batch` requests of low-high tokens (SmolLM2's heads, bf16,
    blocks of 16 in a shuffled cache), one call per layer's cache: a function of the ops
    namespace."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(low, high + 1, (batch,), generator=g).int()
    num_blocks, table = shuffled_blocks(lens, g)
    caches = [
        torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD, generator=g).bfloat16()
        for _ in range(layers)
    ]
    q = torch.randn(batch, HEADS, HEAD, generator=g).bfloat16()
    longest = int(lens.max())

    def run(ops) -> list[torch.Tensor]:
        return [
            ops.paged_decode_attention(q, kv, table, lens, longest, HEAD**-0.5) for kv in caches
        ]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="git revision to compare this checkout's kernels with")
    parser.add_argument("rows", type=int, nargs="*", default=[1, 64, 512])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--attention", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="also time prefill attention on 64 prompts of LOW-HIGH tokens")  # fmt: skip
    parser.add_argument("--decode", type=int, nargs=3, metavar=("B", "LOW", "HIGH"),
                        help="also time decode attention of B requests of LOW-HIGH tokens")  # fmt: skip
    parser.add_argument("--int8", action="store_true",
                        help="also time the products on int8 weights (linear_int8)")  # fmt: skip
    args = parser.parse_args()
    if cpu_ops() is None:
        sys.exit("needs pagedllm's native kernels")
    versions = {"this": torch.ops.pagedllm, args.rev: getattr(torch.ops, build_revision(args.rev))}
    weights = [
        [to_panels((torch.randn(n, k) * 0.05).bfloat16()) for n, k in SHAPES] for _ in range(LAYERS)
    ]

    def products(m: int):
        inputs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}

        def run(ops) -> list[torch.Tensor]:
            out = []
            for layer in weights:
                for (n, k), w in zip(SHAPES, layer):
                    if n == 2 * INTER and hasattr(ops, "linear_silu_mul"):
                        # the MLP's gate / up with SiLU x mul, as the layers run it
                        out.append(ops.linear_silu_mul(inputs[k], w, None, n))
                    elif n == 2 * INTER:  # before the fused op (9dcd9c8): the same bits
                        out.append(ops.silu_and_mul(ops.linear(inputs[k], w, None, n, False)))
                    else:
                        out.append(ops.linear(inputs[k], w, None, n, False))
            return out

        return run

    cases = {f"rows {m:5d}": products(m) for m in args.rows}
    if args.int8:
        int8_weights = []
        for _ in range(LAYERS):
            layer = []
            for n, k in SHAPES:
                q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
                layer.append((to_panels(q), torch.rand(n) * 1e-3, q.sum(dim=1, dtype=torch.int32)))
            int8_weights.append(layer)

        def int8_products(m: int):
            inputs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}

            def run(ops) -> list[torch.Tensor]:
                return [
                    ops.linear_int8(inputs[k], q, scale, colsum, None, n, False)
                    for layer in int8_weights
                    for (n, k), (q, scale, colsum) in zip(SHAPES, layer)
                ]

            return run

        cases.update({f"int8 rows {m:5d}": int8_products(m) for m in args.rows})
    if args.attention:
        low, high = args.attention
        cases[f"attention {low}-{high}"] = prefill_attention_case(low, high)
    if args.decode:
        batch, low, high = args.decode
        cases[f"decode {batch} x {low}-{high}"] = decode_attention_case(batch, low, high)
    for label, run in cases.items():
        a, b = (run(ops) for ops in versions.values())
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
        print(f"{label}: outputs {'identical' if diff == 0 else f'differ by up to {diff:.3g}'}")
    seconds = {(label, v): [] for label in cases for v in versions}
    for r in range(args.rounds):
        for label, run in cases.items():
            order = list(versions.items())
            for name, ops in order if r % 2 else order[::-1]:
                start = time.perf_counter()
                run(ops)
                seconds[label, name].append(time.perf_counter() - start)
    for label in cases:
        this, base = seconds[label, "this"], seconds[label, args.rev]
        ratios = sorted(b / t for b, t in zip(base, this))
        print(
            f"{label}: {args.rev} {statistics.median(base) * 1e3:8.2f} ms  this "
            f"{statistics.median(this) * 1e3:8.2f} ms  speed-up {statistics.median(ratios):.3f} "
            f"(rounds {ratios[0]:.2f} .. {ratios[-1]:.2f})"
        )


if __name__ == "__main__":
    main()
