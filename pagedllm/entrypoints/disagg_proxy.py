"""`pagedllm disagg-proxy`: one OpenAI-compatible endpoint in front of prefill and decode
instances (disaggregated prefill/decode with the `P2pZmqConnector`).

Each completion or chat completion is sent first to a prefill instance with `max_tokens=1`,
no streaming and `kv_transfer_params={"do_remote_decode": true}`; its response carries the
`kv_transfer_params` that say where its KV blocks wait. The original request then goes to a
decode instance with those params; the decode instance pulls the blocks and generates, and
its response (streamed or not) is the client's. Instances of each role are picked round-robin
or least-loaded (fewest requests this proxy has in flight there) among the healthy ones; a
background task checks every instance's `/health`, and one that does not answer is skipped
until it does again (`GET /health` on the proxy lists them all).

Errors are OpenAI-shaped: a client error from an instance (4xx) is passed on as it is; an
unreachable instance is retried on another one of its role, and when none is left the client
gets 503 naming the instances and why they failed; any other instance failure is a 502 that
names the instance.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded")
# What the prefill instance is asked for: compute the prompt, keep its KV for a decode.
_PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_HEALTH_TIMEOUT_S = 2.0


class ProxyError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, message: str, status_code: int, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param = message, int(status_code), param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status_code, "Error"),
                "param": self.param,
                "code": self.status_code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


@dataclass
class Backend:
    """One instance: its base URL, whether its last check or request succeeded, and how many
    of this proxy's requests it is serving now."""

    url: str
    role: str
    healthy: bool = True
    error: str | None = None
    in_flight: int = 0

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "error": self.error,
            "in_flight": self.in_flight,
        }


class BackendPool:
    """The instances of one role and the policy that picks among the healthy ones."""

    def __init__(self, role: str, urls: list[str], policy: str) -> None:
        if not urls:
            raise ValueError(f"at least one {role} instance URL is needed")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {list(POLICIES)}")
        self.role = role
        self.backends = [Backend(url.rstrip("/"), role) for url in urls]
        self.policy = policy
        self._turn = itertools.count()

    def pick(self, exclude: set[str]) -> Backend:
        """A healthy instance not in `exclude`; ProxyError(503) when there is none."""
        live = [b for b in self.backends if b.healthy and b.url not in exclude]
        if not live:
            reasons = "; ".join(f"{b.url}: {b.error or 'excluded'}" for b in self.backends)
            raise ProxyError(
                f"no {self.role} instance is available ({reasons})",
                HTTPStatus.SERVICE_UNAVAILABLE,
            )
        if self.policy == "least_loaded":
            return min(live, key=lambda b: b.in_flight)
        return live[next(self._turn) % len(live)]

    def mark(self, backend: Backend, error: str | None) -> None:
        if error is not None and backend.healthy:
            logger.warning("%s instance %s is down: %s", self.role, backend.url, error)
        elif error is None and not backend.healthy:
            logger.info("%s instance %s is back", self.role, backend.url)
        backend.healthy, backend.error = error is None, error


class DisaggProxy:
    """The proxy's state: both pools and one HTTP client (see the module docstring)."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        policy: str = "round_robin",
        health_check_interval: float = 5.0,
        request_timeout: float = 600.0,
    ) -> None:
        self.prefill = BackendPool("prefill", prefill_urls, policy)
        self.decode = BackendPool("decode", decode_urls, policy)
        self.health_check_interval = health_check_interval
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0))

    async def check_health(self) -> None:
        """Check every instance's /health once."""

        async def check(pool: BackendPool, backend: Backend) -> None:
            try:
                r = await self.client.get(f"{backend.url}/health", timeout=_HEALTH_TIMEOUT_S)
                pool.mark(backend, None if r.status_code == 200 else f"/health: {r.status_code}")
            except httpx.HTTPError as e:
                pool.mark(backend, f"unreachable ({type(e).__name__}: {e})")

        await asyncio.gather(
            *(check(pool, b) for pool in (self.prefill, self.decode) for b in pool.backends)
        )

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_check_interval)

    def health(self) -> JSONResponse:
        body = {
            "prefill": [b.status() for b in self.prefill.backends],
            "decode": [b.status() for b in self.decode.backends],
        }
        ok = all(any(b.healthy for b in pool.backends) for pool in (self.prefill, self.decode))
        return JSONResponse(body, status_code=200 if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    # ---- one request ------------------------------------------------------------------------

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        if body.get("kv_transfer_params") is not None:
            raise ProxyError("kv_transfer_params are set by the proxy", 400, "kv_transfer_params")
        if body.get("n", 1) != 1:
            raise ProxyError("n > 1 is not supported through the disaggregated proxy", 400, "n")
        headers = {**headers, "X-Request-Id": uuid.uuid4().hex}
        prefill_body = {**body, **_prefill_overrides(path)}
        prefill_body.pop("stream_options", None)
        prefill_body.pop("min_tokens", None)
        result = await self._post(self.prefill, path, prefill_body, headers)
        kv_params = result.json().get("kv_transfer_params")
        if not kv_params:
            raise ProxyError(
                f"prefill instance {result.url.host}:{result.url.port} returned no "
                "kv_transfer_params; start it with --kv-transfer-config "
                '\'{"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer"}\'',
                HTTPStatus.BAD_GATEWAY,
            )
        decode_body = {**body, "kv_transfer_params": kv_params}
        if body.get("stream"):
            return await self._stream(path, decode_body, headers)
        result = await self._post(self.decode, path, decode_body, headers)
        return Response(result.content, result.status_code, media_type="application/json")

    async def _post(
        self, pool: BackendPool, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        """POST to an instance of `pool`, trying the next one while they are unreachable."""
        tried: set[str] = set()
        while True:
            backend = pool.pick(tried)
            tried.add(backend.url)
            backend.in_flight += 1
            try:
                response = await self.client.post(backend.url + path, json=body, headers=headers)
            except httpx.TransportError as e:
                pool.mark(backend, f"unreachable ({type(e).__name__}: {e})")
                continue
            finally:
                backend.in_flight -= 1
            _raise_for_status(pool.role, backend, response)
            return response

    async def _stream(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        tried: set[str] = set()
        while True:
            backend = self.decode.pick(tried)
            tried.add(backend.url)
            request = self.client.build_request(
                "POST", backend.url + path, json=body, headers=headers
            )
            backend.in_flight += 1
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as e:
                backend.in_flight -= 1
                self.decode.mark(backend, f"unreachable ({type(e).__name__}: {e})")
                continue
            if response.status_code != 200:
                backend.in_flight -= 1
                await response.aread()
                await response.aclose()
                _raise_for_status("decode", backend, response)
            return StreamingResponse(_relay(response, backend), media_type="text/event-stream")


def _prefill_overrides(path: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": dict(_PREFILL_KV_PARAMS),
    }
    if path.endswith("/chat/completions"):
        overrides["max_completion_tokens"] = 1
    return overrides


def _raise_for_status(role: str, backend: Backend, response: httpx.Response) -> None:
    """Pass a client error on unchanged; turn any other failure into a 502 naming the
    instance."""
    if response.status_code == 200:
        return
    try:
        detail = response.json()
    except json.JSONDecodeError:
        detail = None
    if 400 <= response.status_code < 500 and isinstance(detail, dict) and "error" in detail:
        error = detail["error"]
        raise ProxyError(error.get("message", ""), response.status_code, error.get("param"))
    message = (detail or {}).get("error", {}).get("message") if isinstance(detail, dict) else None
    raise ProxyError(
        f"{role} instance {backend.url} failed with HTTP {response.status_code}: "
        f"{message or response.text[:200]}",
        HTTPStatus.BAD_GATEWAY,
    )


async def _relay(response: httpx.Response, backend: Backend) -> AsyncIterator[bytes]:
    """Forward a decode instance's event stream; if it breaks off, end the client's stream
    with an error event and [DONE]."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        error = ProxyError(
            f"decode instance {backend.url} broke off the stream: {type(e).__name__}: {e}",
            HTTPStatus.BAD_GATEWAY,
        )
        yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
    finally:
        backend.in_flight -= 1
        await response.aclose()


def build_app(proxy: DisaggProxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(proxy.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)

    async def forward(path: str, raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except json.JSONDecodeError as e:
            return ProxyError(f"the request body is not JSON: {e}", 400).response()
        if not isinstance(body, dict):
            return ProxyError("the request body must be a JSON object", 400).response()
        headers = {}
        if "authorization" in raw_request.headers:
            headers["Authorization"] = raw_request.headers["authorization"]
        try:
            return await proxy.handle(path, body, headers)
        except ProxyError as e:
            return e.response()

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await forward("/v1/completions", raw_request)

    @app.post("/v1/chat/completions")
    async def chat(raw_request: Request) -> Response:
        return await forward("/v1/chat/completions", raw_request)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            backend = proxy.decode.pick(set())
            r = await proxy.client.get(f"{backend.url}/v1/models")
        except ProxyError as e:
            return e.response()
        except httpx.HTTPError as e:
            return ProxyError(f"decode instance unreachable: {e}", 503).response()
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return proxy.health()

    return app


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1", help="Host to bind.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin")
    parser.add_argument(
        "--health-check-interval", type=float, default=5.0, help="Seconds between checks."
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="Seconds one backend call may take."
    )
    return parser


def run_proxy(args: argparse.Namespace) -> None:
    import uvicorn

    proxy = DisaggProxy(
        args.prefill, args.decode, args.policy, args.health_check_interval, args.request_timeout
    )
    logger.info(
        "Disaggregated proxy on %s:%d: prefill %s, decode %s (%s)",
        args.host,
        args.port,
        args.prefill,
        args.decode,
        args.policy,
    )
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")
