"""`pagedllm bench serve`: drive a running OpenAI-compatible server and measure it.

Requests (from the dataset flags) are sent as streaming completions (or chat completions) by an
asyncio client. Arrivals follow a gamma process: the gap before each next request is drawn
from `Gamma(shape=burstiness, scale=1 / (request_rate * burstiness))`, so the mean rate is
`--request-rate` and `--burstiness 1.0` is a Poisson process (smaller is burstier); an
infinite rate sends everything at once. `--max-concurrency` caps requests in flight.
Per request the client records the time to the first streamed chunk (TTFT), the gaps
between later chunks (ITL), the whole latency, and the server's `usage.completion_tokens`;
`pagedllm.benchmarks.metrics` turns those into vLLM's result block. The flags are vLLM's
(`--backend vllm | openai | openai-chat` picks the endpoint; the sampling flags and
`--extra-body` go into every body; `--num-warmups`, `--header`, `--request-id-prefix`,
`--ready-check-timeout-sec`, `--label`), so a `vllm bench serve` command line runs as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests
from pagedllm.benchmarks.metrics import (
    BenchmarkMetrics,
    RequestFuncOutput,
    calculate_metrics,
    output_len_of,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    percentile_label,
)
from pagedllm.benchmarks.offline import write_json

T = TypeVar("T")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# vLLM's --backend names for the two OpenAI endpoints this client speaks.
BACKEND_ENDPOINTS = {
    "vllm": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
# vLLM's sampling flags: sent in every request body, only when given.
SAMPLING_FLAGS = (
    "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)  # fmt: skip
# A benchmark may run for hours; one request never times out before that.
_HTTP_TIMEOUT_S = 6 * 60 * 60
_METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestInput:
    """What one HTTP request sends."""

    api_url: str
    model: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    temperature: float = 0.0
    ignore_eos: bool = False
    # More body fields (vLLM's sampling flags and --extra-body), and HTTP headers.
    extra_body: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.engine.arg_utils import EngineArgs, json_object_arg

    parser.add_argument("--base-url", default=None, help="server URL (overrides --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--backend",
        choices=sorted(BACKEND_ENDPOINTS),
        default=None,
        help="vLLM's name for the API: vllm / openai (/v1/completions) or openai-chat "
        "(/v1/chat/completions); sets the default --endpoint",
    )
    parser.add_argument(
        "--endpoint", choices=ENDPOINTS, default=None, help="default: /v1/completions"
    )
    parser.add_argument(
        "--label", default=None, help="the result's backend name and file prefix (pagedllm)"
    )
    parser.add_argument(
        "--model", default=None, help="model path (tokenizer); default: the server's first model"
    )
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1.0: Poisson arrivals")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    for name in SAMPLING_FLAGS:
        kind = int if name == "top_k" else float
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=None, help=f"send {name} (when given)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true")
    parser.add_argument(
        "--extra-body",
        type=json_object_arg,
        default=None,
        help="JSON object merged into every request body, e.g. '{\"min_tokens\": 8}'",
    )
    parser.add_argument(
        "--header",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="HTTP headers sent with every request",
    )
    parser.add_argument(
        "--request-id-prefix",
        default=None,
        help="send X-Request-Id: PREFIX<i> with request i (the server's request ids)",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="requests sent (and not measured) before the run, after the test request",
    )
    parser.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="wait up to this long for the server to answer /v1/models before starting "
        "(default 0: an unreachable server is an error at once)",
    )
    parser.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:500"
    )
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    parser.add_argument("--metric-percentiles", default="99")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--save-result", action="store_true", help="write vLLM's JSON result file")
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: add per-request lengths, TTFTs, ITLs, texts and errors",
    )
    parser.add_argument("--result-dir", default=None, help="where --save-result writes")
    parser.add_argument(
        "--result-filename",
        default=None,
        help="file name for --save-result (default: vLLM's "
        "{backend}-{rate}qps[-concurrency{n}]-{model}-{date}.json)",
    )
    parser.add_argument(
        "--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="added to the result"
    )
    parser.add_argument(
        "--output-json", default=None, help="write the detailed result to this path"
    )
    parser.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(parser)
    # Engine flags are accepted so a `serve` command line can be reused; `--tokenizer`,
    # `--served-model-name` (the model name sent), `--trust-remote-code` and `--seed` apply.
    EngineArgs.add_cli_args(parser)


def _request_body(req: RequestInput, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.extra_body:
        body.update(req.extra_body)
    return body


def _chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    """The text of a streamed chunk, or None when it carries no token (a usage chunk, a chat
    stream's role announcement)."""
    choices = data.get("choices")
    if not choices:
        return None
    if chat:
        delta = choices[0].get("delta") or {}
        if "role" in delta and not delta.get("content") and choices[0].get("logprobs") is None:
            return None  # the role announcement, not a token (a server may send it early)
        return delta.get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: Any, req: RequestInput, chat: bool) -> RequestFuncOutput:
    """POST one streaming request; time every chunk that carries a choice."""
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    out.start_time = start
    got_first = False
    try:
        body = _request_body(req, chat)
        async with client.stream("POST", req.api_url, json=body, headers=req.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {body[:500]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if data.get("error"):
                    out.error = f"error in stream: {data['error']}"
                    return out
                text = _chunk_text(data, chat)
                if text is not None:
                    if got_first:
                        out.itl.append(now - last)
                    else:
                        out.ttft = now - start
                        got_first = True
                    last = now
                    out.generated_text += text
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
        if not got_first:
            out.error = "the stream ended without a token (no TTFT)"
        else:
            out.latency = last - start
            out.success = True
    except Exception:
        out.error = traceback.format_exc(limit=3)
    return out


async def arrivals(
    items: list[T], rate: float, burstiness: float, rng: np.random.Generator
) -> AsyncIterator[T]:
    """Yield items with gamma-distributed gaps (mean `1 / rate`); no gaps for `rate=inf`."""
    theta = 1.0 / (rate * burstiness) if rate != float("inf") else 0.0
    for i, item in enumerate(items):
        yield item
        if theta and i + 1 < len(items):
            await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


def _validate(args: argparse.Namespace) -> None:
    """Check the flags; resolve --backend / --endpoint into `args.endpoint`."""
    if args.backend is not None:
        implied = BACKEND_ENDPOINTS[args.backend]
        if args.endpoint is not None and args.endpoint != implied:
            raise ValueError(
                f"--backend {args.backend} sends to {implied}, not --endpoint {args.endpoint}"
            )
        args.endpoint = implied
    elif args.endpoint is None:
        args.endpoint = "/v1/completions"
    _parse_key_values(args.header, "--header")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups={args.num_warmups} must be 0 or more")
    if not args.ready_check_timeout_sec >= 0:
        raise ValueError(
            f"--ready-check-timeout-sec={args.ready_check_timeout_sec} must be 0 or more"
        )
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} must be positive")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness={args.burstiness} must be positive")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be positive")


async def _first_model(client: Any, base_url: str) -> str:
    import httpx

    try:
        resp = await client.get(base_url + "/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(
            f"cannot reach a server at {base_url} ({e or type(e).__name__}); start one, or "
            "pass --base-url / --host / --port"
        ) from e
    if resp.status_code != 200:
        raise ValueError(
            f"{base_url}/v1/models answered HTTP {resp.status_code}: {resp.text[:300]}; "
            "pass --model (and --api-key if the server wants one)"
        )
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_benchmark(
    args: argparse.Namespace, requests: list[SampleRequest], base_url: str, model_name: str
) -> tuple[list[RequestFuncOutput], float]:
    """Send every request (after one test request) and return their outputs and the wall
    time from the first send to the last completion."""
    import httpx
    from tqdm import tqdm

    chat = args.endpoint == "/v1/chat/completions"
    api_url = base_url + args.endpoint

    extra_body = {n: getattr(args, n) for n in SAMPLING_FLAGS if getattr(args, n) is not None}
    extra_body.update(args.extra_body or {})

    def make_input(i: int, r: SampleRequest) -> RequestInput:
        prompt: str | list[int] = r.prompt if r.prompt is not None else r.prompt_token_ids
        headers = None
        if args.request_id_prefix is not None:
            headers = {"X-Request-Id": f"{args.request_id_prefix}{i}"}
        return RequestInput(
            api_url, model_name, prompt, r.prompt_len, r.expected_output_len,
            args.temperature, args.ignore_eos, extra_body, headers,
        )  # fmt: skip

    inputs = [make_input(i, r) for i, r in enumerate(requests)]
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(_HTTP_TIMEOUT_S)
    headers = client_headers(args)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        print("Starting initial single prompt test run...")
        test = await send_request(client, _unlabelled(inputs[0]), chat)
        if not test.success:
            raise ValueError(f"the initial test request failed; check the server: {test.error}")
        if args.num_warmups:
            print(f"Warming up with {args.num_warmups} request(s)...")
            gate = asyncio.Semaphore(args.max_concurrency or args.num_warmups)

            async def warm(req: RequestInput) -> RequestFuncOutput:
                async with gate:
                    return await send_request(client, _unlabelled(req), chat)

            warm_inputs = [inputs[i % len(inputs)] for i in range(args.num_warmups)]
            await asyncio.gather(*(warm(r) for r in warm_inputs))
        print("Initial test run completed. Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        kind = " (Poisson process)" if args.burstiness == 1.0 else ""
        print(f"Burstiness factor: {args.burstiness}{kind}")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        bar = tqdm(total=len(inputs), disable=args.disable_tqdm, dynamic_ncols=True)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req: RequestInput) -> RequestFuncOutput:
            if gate is None:
                result = await send_request(client, req, chat)
            else:
                async with gate:
                    result = await send_request(client, req, chat)
            bar.update(1)
            return result

        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        tasks = []
        async for req in arrivals(inputs, args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(one(req)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return outputs, duration


def format_results(
    metrics: BenchmarkMetrics,
    duration: float,
    args: argparse.Namespace,
    selected_metrics: list[str],
    goodput: bool,
) -> tuple[list[str], dict[str, Any]]:
    """vLLM's result block (lines) and the matching JSON fields."""
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(row("Successful requests:", metrics.completed))
    if args.max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", args.max_concurrency))
    if args.request_rate != float("inf"):
        lines.append(rowf("Request rate configured (RPS):", args.request_rate))
    lines.append(rowf("Benchmark duration (s):", duration))
    lines.append(row("Total input tokens:", metrics.total_input))
    lines.append(row("Total generated tokens:", metrics.total_output))
    lines.append(rowf("Request throughput (req/s):", metrics.request_throughput))
    if goodput:
        lines.append(rowf("Request goodput (req/s):", metrics.request_goodput))
    lines.append(rowf("Output token throughput (tok/s):", metrics.output_throughput))
    lines.append(rowf("Total Token throughput (tok/s):", metrics.total_token_throughput))
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for name in selected_metrics:
        short, header = _METRIC_HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median")):
            value = getattr(metrics, f"{stat}_{name}_ms")
            lines.append(rowf(f"{label} {short} (ms):", value))
            result[f"{stat}_{name}_ms"] = value
        result[f"std_{name}_ms"] = getattr(metrics, f"std_{name}_ms")
        for p, value in getattr(metrics, f"percentiles_{name}_ms"):
            label = percentile_label(p)
            lines.append(rowf(f"P{label} {short} (ms):", value))
            result[f"p{label}_{name}_ms"] = value
    lines.append("=" * 50)
    return lines, result


def _unlabelled(req: RequestInput) -> RequestInput:
    """`req` without its X-Request-Id (the test and warm-up requests reuse measured ones'
    inputs; a server may refuse a request id already in flight)."""
    return dataclasses.replace(req, headers=None)


def main(args: argparse.Namespace) -> int:
    import httpx

    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    _validate(args)
    # httpx logs every request at INFO, which would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    selected_metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_metric_percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.ready_check_timeout_sec > 0:
        asyncio.run(
            _wait_ready(httpx, base_url, client_headers(args), args.ready_check_timeout_sec)
        )
    model_id = args.model
    if model_id is None:
        model_id = asyncio.run(_list_first_model(httpx, base_url, client_headers(args)))
    model_name = args.served_model_name[0] if args.served_model_name else model_id
    tokenizer_id = args.tokenizer or model_id
    tokenizer = get_tokenizer(tokenizer_id, args.trust_remote_code)
    requests = get_requests(args, tokenizer)
    if args.endpoint == "/v1/chat/completions":
        # Chat messages are text: random token-id prompts go as their decoded text (as in
        # vLLM), so the server's token count of them may differ a little from `prompt_len`.
        for r in requests:
            if r.prompt is None:
                r.prompt = tokenizer.decode(r.prompt_token_ids)

    outputs, duration = asyncio.run(run_benchmark(args, requests, base_url, model_name))
    metrics = calculate_metrics(outputs, duration, percentiles, slos or None)
    lines, result = format_results(metrics, duration, args, selected_metrics, bool(slos))
    print("\n".join(lines))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} request(s) failed; the first error: {failed[0]}")
    if args.save_result or args.output_json:
        now = datetime.now().strftime("%Y%m%d-%H%M%S")
        result.update(
            date=now,
            backend=args.label or "pagedllm",
            endpoint=args.endpoint,
            model_id=model_id,
            tokenizer_id=tokenizer_id,
            num_prompts=len(requests),
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            goodput=slos or None,
            **_parse_key_values(args.metadata, "--metadata"),
        )
        detailed = dict(
            input_lens=[o.prompt_len for o in outputs],
            output_lens=[output_len_of(o) for o in outputs],
            ttfts=[o.ttft for o in outputs],
            itls=[o.itl for o in outputs],
            generated_texts=[o.generated_text for o in outputs],
            errors=[o.error for o in outputs],
        )
        if args.save_result:
            path = result_path(args, model_id, now)
            write_json(path, {**result, **detailed} if args.save_detailed else result)
            print(f"Saved the result to {path}")
        if args.output_json:
            write_json(args.output_json, {**result, **detailed})
    return 0


def client_headers(args: argparse.Namespace) -> dict[str, str]:
    """Every request's headers: --header's, and the API key's Authorization."""
    headers = _parse_key_values(getattr(args, "header", None), "--header")
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def result_path(args: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's --save-result file: --result-filename, or
    `pagedllm-{rate}qps[-concurrency{n}]-{model}-{date}.json`, in --result-dir."""
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = os.path.basename(model_id.rstrip("/")) or "model"
        label = args.label or "pagedllm"
        name = f"{label}-{args.request_rate}qps{concurrency}-{model}-{date}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name


def _parse_key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    pairs = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


async def _wait_ready(httpx: Any, base_url: str, headers: dict[str, str], timeout: float) -> None:
    """Poll /v1/models (`_first_model`) until it lists a model or `timeout` seconds pass
    (then the caller's own request reports what is wrong)."""
    print(f"Waiting up to {timeout:g} s for {base_url} to answer...")
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
        while True:
            try:
                await _first_model(client, base_url)
                return
            except ValueError:
                if time.monotonic() >= deadline:
                    return
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


async def _list_first_model(httpx: Any, base_url: str, headers: dict[str, str]) -> str:
    async with httpx.AsyncClient(timeout=30.0, headers=headers) as client:
        return await _first_model(client, base_url)
