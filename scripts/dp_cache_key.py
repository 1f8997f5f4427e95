"""`prompt_cache_key` with data parallelism: requests that share a long document prefix, sent
to `pagedllm serve --data-parallel-size 2` with and without a key per document
(BENCHMARKS.md, "prompt_cache_key across data-parallel engines").

Each round makes `--docs` fresh documents of `--prefix-len` random token ids, and
`--per-doc` requests per document (the prefix plus `--suffix-len` fresh ids each), shuffled,
sent `--concurrency` at a time as streamed completions of `--max-tokens` tokens. The modes
alternate round by round on one server: `key` (each request carries its document's id as
`prompt_cache_key`) and `none`. Prints per round the wall time, the median and p90 time to
first token, and the prefix cache's hit rate over the round (the engines' summed
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`), then the medians.

    python scripts/dp_cache_key.py --model .demo-model/SmolLM2-135M-Instruct --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.benchmarks.server_process import ServerProcess


def cache_counts(url: str) -> tuple[float, float]:
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


async def run_round(url: str, args: argparse.Namespace, keyed: bool, rng: random.Random) -> dict:
    docs = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.docs)]
    requests = [
        (d, docs[d] + [rng.randrange(100, 40000) for _ in range(args.suffix_len)])
        for d in range(args.docs)
        for _ in range(args.per_doc)
    ]
    rng.shuffle(requests)
    ttfts: list[float] = []
    gate = asyncio.Semaphore(args.concurrency)
    tag = rng.randrange(1 << 30)

    async def one(client: httpx.AsyncClient, doc: int, prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        if keyed:
            body["prompt_cache_key"] = f"doc-{tag}-{doc}"
        async with gate:
            start = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                first = True
                async for line in r.aiter_lines():
                    if first and line.startswith("data: {"):
                        ttfts.append(time.perf_counter() - start)
                        first = False

    hits0, queries0 = cache_counts(url)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, d, p) for d, p in requests))
    wall = time.perf_counter() - start
    hits1, queries1 = cache_counts(url)
    ttfts.sort()
    return {
        "wall_s": wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--per-doc", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1536)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--serve-args", default="--data-parallel-size 2 --max-model-len 2048")
    args = parser.parse_args()
    rng = random.Random(0)
    results: dict[str, list[dict]] = {"key": [], "none": []}
    with ServerProcess(args.model, args.serve_args.split()) as server:
        asyncio.run(
            run_round(server.url, argparse.Namespace(**{**vars(args), "docs": 1}), False, rng)
        )  # fmt: skip (a warm-up)
        for i in range(args.rounds):
            mode = ("key", "none")[i % 2]
            result = asyncio.run(run_round(server.url, args, mode == "key", rng))
            results[mode].append(result)
            print(mode, {k: round(v, 3) for k, v in result.items()}, flush=True)
    for mode, rows in results.items():
        print(
            mode, "medians:", {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
        )


if __name__ == "__main__":
    main()
