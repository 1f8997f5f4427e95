"""How the server's event loop fares with tokenization (against a running server):

1. small requests: `/tokenize` of a short prompt, many clients at once -> requests/s;
2. big prompts: while `--big` clients each send a prompt of `--big-chars` characters to
   `/v1/completions` (tokenized, then refused for its length), `/health` is polled -> its
   latency (median, max) and how long the big requests took.

    python scripts/loop_responsiveness.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


async def small_requests(url: str, clients: int, total: int) -> float:
    """Requests per second of `total` short /tokenize calls over `clients` connections."""
    remaining = total

    async def client() -> None:
        nonlocal remaining
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while remaining > 0:
                remaining -= 1
                r = await http.post("/tokenize", json={"prompt": "a short prompt to count"})
                r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return total / (time.perf_counter() - t0)


async def health_during_big_prompts(url: str, big: int, chars: int) -> dict[str, float]:
    prompt = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def one_big() -> float:
            t0 = time.perf_counter()
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400, r.text[:200]  # longer than max_model_len
            return time.perf_counter() - t0

        bigs = asyncio.gather(*(one_big() for _ in range(big)))
        latencies = []
        while not bigs.done():
            t0 = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        durations = await bigs
    return {
        "health_p50_ms": 1000 * statistics.median(latencies),
        "health_max_ms": 1000 * max(latencies),
        "health_polls": len(latencies),
        "big_request_s": max(durations),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--big", type=int, default=4)
    parser.add_argument("--big-chars", type=int, default=1_000_000)
    args = parser.parse_args()
    rps = asyncio.run(small_requests(args.url, args.clients, args.requests))
    result = asyncio.run(health_during_big_prompts(args.url, args.big, args.big_chars))
    print({"small_tokenize_rps": round(rps, 1), **{k: round(v, 2) for k, v in result.items()}})


if __name__ == "__main__":
    main()
