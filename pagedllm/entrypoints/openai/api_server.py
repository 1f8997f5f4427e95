"""The OpenAI-compatible HTTP server: a FastAPI app around one `AsyncLLM`.

`build_app(args)` makes the app; its lifespan starts the AsyncLLM (and with it the engine
process) and shuts it down when uvicorn stops (SIGTERM, Ctrl-C), so no engine process
outlives the server. `run_server(args)` binds the port first (a port in use fails at once,
not after the engine has loaded), then runs the app with uvicorn on that socket; while the
engine loads, the socket answers 503 "starting" (starting.py, for `/ready` probes).

Every error is OpenAI-shaped (`{"error": {message, type, param, code}}`, errors.py): 400 for
invalid input and for what limits.py refuses, 401 for a missing or wrong API key on `/v1/*`,
404 for an unknown model or route, 405, 500 for anything unexpected, 503 while the engine is
dead. If the engine dies, in-flight requests fail with that 503 error and the server exits
with status 1 so that a supervisor restarts it (`--keep-alive-on-engine-death` keeps it up,
answering 503). `python -m pagedllm.entrypoints.openai.api_server --model DIR` also runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import importlib
import inspect
import logging
import os
import socket
import stat
import sys
import uuid
from collections.abc import AsyncGenerator, Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.utils import ClientConfig
from pagedllm.entrypoints.dashboard import Dashboard, register_dashboard_routes
from pagedllm.entrypoints.openai.cli_args import (
    expand_config_file,
    log_requests_enabled,
    make_arg_parser,
)
from pagedllm.entrypoints.openai.errors import (
    CatchAllMiddleware,
    HTTPMiddleware,
    OpenAIError,
    error_response,
    register_error_handlers,
)
from pagedllm.entrypoints.openai.limits import (
    CheckedJSONRoute,
    RequestBodyLimitMiddleware,
    ServerLimits,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import ServingOptions
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.starting import answering_while_starting

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.api_server_procs import StartGate

logger = logging.getLogger(__name__)

# How often the lifespan's watchdog checks whether the engine died.
_ENGINE_WATCHDOG_INTERVAL_S = 0.5
EXIT_CODE_ENGINE_DEAD = 1


class APIKeyMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): `/v1/*` needs
    `Authorization: Bearer <key>`; other routes (health, metrics) stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = OpenAIError(
                    "Unauthorized: a valid API key is required (Authorization: Bearer KEY)",
                    HTTPStatus.UNAUTHORIZED,
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(coro: Awaitable[Any], request: Request) -> Any:
    """Run a handler, cancelling it (and so aborting its engine requests) if the client
    disconnects first. Returns None when the client is gone."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        raise
    finally:
        watcher.cancel()
    if handler in done:
        return handler.result()
    handler.cancel()
    return None


def _data_parallel_rank(raw_request: Request) -> int | None:
    """vLLM's `X-data-parallel-rank` header: the data-parallel engine to run the request on
    (an external router's choice), instead of the load balancer's."""
    value = raw_request.headers.get("X-data-parallel-rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise OpenAIError(
            f"X-data-parallel-rank must be an integer, got {value!r}", param="X-data-parallel-rank"
        ) from None


def _respond(result: Any, raw_request: Request) -> Response:
    if result is None:  # client disconnected
        return Response(status_code=499)
    if isinstance(result, AsyncGenerator):
        interval = raw_request.app.state.sse_keep_alive_s
        if interval:
            result = _with_keep_alive(result, interval)
        return StreamingResponse(result, media_type="text/event-stream")
    if isinstance(result, dict):
        return JSONResponse(result)
    return JSONResponse(result.model_dump(exclude_unset=False))


async def _with_keep_alive(
    events: AsyncGenerator[str, None], interval: float
) -> AsyncGenerator[str, None]:
    """`events`, plus an SSE comment line whenever none came for `interval` seconds
    (--sse-keep-alive-interval: proxies with read timeouts keep a queued or slow stream
    open). The pending event is awaited, never cancelled, across keep-alives."""
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(events))
            while not (await asyncio.wait({pending}, timeout=interval))[0]:
                yield ": keep-alive\n\n"
            try:
                yield pending.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None and not pending.done():  # the client went away: abort
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await events.aclose()


class ServerLoadMiddleware(HTTPMiddleware):
    """--enable-server-load-tracking: `app.state.server_load` counts the generation requests
    in flight (from arrival until their response, streamed or not, has ended), as vLLM's
    `GET /load` reports it."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load -= 1


def engine_health(engine: AsyncLLM) -> tuple[int, dict[str, Any] | None]:
    """(status, body) of `/health` for a live engine: 503 with the reason when every live
    engine is stalled (engine/stall.py); 200 "degraded" naming the dead and stalled
    data-parallel engines while others serve on; 200 with no body when all is well."""
    dead, stalled = engine.dead_engines, engine.stalled_engines
    live = engine.engine_core.num_engines - len(dead)
    if stalled and len(stalled) >= live:
        reason = "; ".join(stalled[rank] for rank in sorted(stalled))
        body = OpenAIError(reason, HTTPStatus.SERVICE_UNAVAILABLE).to_dict()
        body |= {"status": "stalled", "stalled_engines": _by_rank(stalled)}
        return HTTPStatus.SERVICE_UNAVAILABLE, body
    if not dead and not stalled:
        return HTTPStatus.OK, None
    body = {"status": "degraded"}
    if dead:
        body["dead_engines"] = _by_rank(dead)
    if stalled:
        body["stalled_engines"] = _by_rank(stalled)
    return HTTPStatus.OK, body


def _by_rank(reasons: dict[int, str]) -> dict[str, str]:
    return {str(rank): reason for rank, reason in sorted(reasons.items())}


def _register_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        engine = raw_request.app.state.engine
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error_response(OpenAIError.from_exception(e))
        status, body = engine_health(engine)
        if body is None:
            return Response(status_code=200)
        return JSONResponse(body, status_code=status)

    @app.get("/ready")
    async def ready(raw_request: Request) -> Response:
        """200 once the engine can take requests; 503 while it cannot (dead or stalled)."""
        engine = raw_request.app.state.engine
        status, body = (
            (
                HTTPStatus.SERVICE_UNAVAILABLE,
                OpenAIError.from_exception(engine.dead_error).to_dict(),
            )
            if engine.errored
            else engine_health(engine)
        )
        if status != HTTPStatus.OK:
            return JSONResponse({"ready": False, **(body or {})}, status_code=status)
        return JSONResponse({"ready": True})

    @app.get("/version")
    async def version() -> JSONResponse:
        from pagedllm import __version__

        return JSONResponse({"version": __version__})

    # HEAD too: vLLM mounts prometheus_client's ASGI app here, which answers any method, and
    # scrapers probe with HEAD before they GET (aiperf's server-metrics reachability check).
    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(raw_request: Request) -> Response:
        engine = raw_request.app.state.engine
        if not engine.errored:
            engine.stalled_engines  # noqa: B018 (sets the vllm:engine_stalled gauges)
        prometheus = engine.prometheus
        body = prometheus.render() if prometheus is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw_request: Request) -> Response:
        """Forget every cached prefix (vLLM's endpoint, e.g. between benchmark runs); 409
        while requests still hold KV blocks."""
        if not await raw_request.app.state.engine.reset_prefix_cache():
            return error_response(
                OpenAIError(
                    "the prefix cache can only be reset while no request holds KV blocks",
                    HTTPStatus.CONFLICT,
                )
            )
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(raw_request: Request) -> JSONResponse:
        state = raw_request.app.state
        cards = [
            ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
            for name in state.served_model_names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        handler: OpenAIServingCompletion = raw_request.app.state.serving_completion
        coro = handler.create_completion(
            request, raw_request.headers.get("X-Request-Id"), _data_parallel_rank(raw_request)
        )
        return _respond(await with_cancellation(coro, raw_request), raw_request)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, raw_request: Request) -> Response:
        handler: OpenAIServingChat = raw_request.app.state.serving_chat
        coro = handler.create_chat_completion(
            request, raw_request.headers.get("X-Request-Id"), _data_parallel_rank(raw_request)
        )
        return _respond(await with_cancellation(coro, raw_request), raw_request)

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        handler: OpenAIServingResponses = raw_request.app.state.serving_responses
        coro = handler.create_response(
            request, raw_request.headers.get("X-Request-Id"), _data_parallel_rank(raw_request)
        )
        return _respond(await with_cancellation(coro, raw_request), raw_request)

    @app.post("/tokenize")
    async def tokenize(
        request: TokenizeChatRequest | TokenizeCompletionRequest, raw_request: Request
    ) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
        return JSONResponse((await handler.create_tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
        return JSONResponse((await handler.create_detokenize(request)).model_dump())


def _register_load_route(app: FastAPI) -> None:
    @app.get("/load")
    async def load(raw_request: Request) -> JSONResponse:
        return JSONResponse({"server_load": raw_request.app.state.server_load})


def _add_user_middleware(app: FastAPI, import_path: str) -> None:
    """--middleware: an ASGI middleware class (`app.add_middleware`) or an `async def
    (request, call_next)` function (`app.middleware("http")`), by import path."""
    module_name, _, name = import_path.rpartition(".")
    try:
        imported = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--middleware {import_path!r} cannot be imported: {e}") from e
    if inspect.isclass(imported):
        app.add_middleware(imported)
    elif inspect.iscoroutinefunction(imported):
        app.middleware("http")(imported)
    else:
        raise ValueError(f"--middleware {import_path!r} is neither a class nor an async function")


def _register_tokenizer_info_route(app: FastAPI) -> None:
    @app.get("/tokenizer_info")
    async def tokenizer_info(raw_request: Request) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
        return JSONResponse(handler.tokenizer_info())


def init_app_state(app: FastAPI, engine: AsyncLLM, args: argparse.Namespace) -> None:
    """Attach the engine and the endpoint handlers to `app.state`."""
    mc = engine.model_config
    names = mc.served_model_names
    state = app.state
    state.engine = engine
    state.served_model_names = names
    state.model_path = mc.model
    state.max_model_len = mc.max_model_len
    limits = ServerLimits.from_args(args).for_model(engine.tokenizer, mc.max_model_len)
    logger.info(
        "Request limits: body %d bytes, prompt %d characters, n <= %d",
        limits.max_request_body_bytes,
        limits.max_prompt_chars,
        limits.max_n_sequences,
    )
    options = ServingOptions.from_args(args)
    state.serving_completion = OpenAIServingCompletion(engine, names, limits, options)
    state.serving_chat = OpenAIServingChat(
        engine,
        names,
        limits,
        enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=engine.config.structured_outputs_config.reasoning_parser,
        options=options,
    )
    state.serving_responses = OpenAIServingResponses(state.serving_chat)
    state.serving_tokenization = OpenAIServingTokenization(engine, names, limits, options=options)


async def _engine_watchdog(app: FastAPI, engine: AsyncLLM, keep_alive: bool) -> None:
    """Once the engine is dead (its in-flight requests have failed with 503 by then), ask
    uvicorn to exit (`app.state.request_shutdown`, set by `run_server`) unless `keep_alive`."""
    while not engine.errored:
        await asyncio.sleep(_ENGINE_WATCHDOG_INTERVAL_S)
    request_shutdown = getattr(app.state, "request_shutdown", None)
    if engine.engine_core.stopped_by_signal:
        # A Ctrl-C or SIGTERM stopped the engine (with --api-server-count, the head stops the
        # engines and these servers together): a shutdown, not a death to report.
        logger.info("The engine was stopped by a signal; the server shuts down")
        if request_shutdown is not None:
            request_shutdown()
        return
    if keep_alive:
        logger.error("The engine is dead; serving 503s (--keep-alive-on-engine-death)")
        return
    logger.error(
        "The engine is dead; the server exits with status %d so that it can be restarted "
        "(--keep-alive-on-engine-death keeps it up)",
        EXIT_CODE_ENGINE_DEAD,
    )
    app.state.engine_dead_exit = True
    if request_shutdown is not None:
        request_shutdown()


def build_app(
    args: argparse.Namespace,
    engine: AsyncLLM | None = None,
    client_config: ClientConfig | None = None,
    engine_config: Any = None,
) -> FastAPI:
    """The FastAPI app. Without `engine`, the lifespan builds one (from `engine_config`, else
    from `args`) and owns it (shuts it down on exit); a given engine stays the caller's.
    `client_config`: this is one of several API servers, whose engines another process
    launched."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        owned = engine is None
        if owned:
            config = engine_config
            if config is None:
                from pagedllm.engine.arg_utils import EngineArgs

                config = EngineArgs.from_cli_args(args).create_engine_config()
            # Loaded off the event loop, so the port can answer 503 "starting" meanwhile.
            async with answering_while_starting(getattr(app.state, "listen_socket", None)):
                the_engine = await asyncio.to_thread(
                    AsyncLLM,
                    config,
                    log_stats=not getattr(args, "disable_log_stats", False),
                    log_requests=log_requests_enabled(args),
                    client_config=client_config,
                )
            gate = getattr(app.state, "start_gate", None)
            if gate is not None:  # one of several API servers: open together
                gate.arrive()
                await gate.wait_all()
        else:
            the_engine = engine
        watchdog = dashboard = None
        try:
            init_app_state(app, the_engine, args)
            if not getattr(args, "disable_dashboard", False):
                closing = getattr(app.state, "server_should_exit", lambda: False)
                dashboard = app.state.dashboard = Dashboard(the_engine, is_closing=closing)
                dashboard.start()
            keep_alive = bool(getattr(args, "keep_alive_on_engine_death", False))
            watchdog = asyncio.create_task(_engine_watchdog(app, the_engine, keep_alive))
            yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if dashboard is not None:
                dashboard.stop()
            if owned:
                logger.info("Shutting down the engine")
                the_engine.shutdown()
            # After a SIGTERM uvicorn re-raises the signal once the app has shut down, so
            # `run_server`'s own cleanup never runs: the --uds file goes here.
            _remove_socket_file(getattr(app.state, "unix_socket_path", None))

    docs: dict[str, Any] = {}
    if getattr(args, "disable_fastapi_docs", False):  # no /docs, /redoc, /openapi.json
        docs = dict(openapi_url=None, docs_url=None, redoc_url=None)
    app = FastAPI(lifespan=lifespan, root_path=getattr(args, "root_path", None) or "", **docs)
    app.router.route_class = CheckedJSONRoute
    app.state.sse_keep_alive_s = getattr(args, "sse_keep_alive_interval", 0)
    _register_routes(app)
    if getattr(args, "enable_server_load_tracking", False):
        _register_load_route(app)  # vLLM's opt-in /load: absent (404) without it
    if getattr(args, "enable_tokenizer_info_endpoint", False):
        _register_tokenizer_info_route(app)  # vLLM's opt-in route: absent (404) without it
    if not getattr(args, "disable_dashboard", False):
        register_dashboard_routes(
            app, getattr(args, "api_key", None), bool(getattr(args, "ssl_certfile", None))
        )
    register_error_handlers(app)
    if getattr(args, "api_key", None):
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    max_body = ServerLimits.from_args(args).max_request_body_bytes  # bad flags: fail now
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=max_body)
    app.add_middleware(CatchAllMiddleware)
    if getattr(args, "enable_request_id_headers", False):
        app.add_middleware(RequestIdHeaderMiddleware)
    if getattr(args, "enable_server_load_tracking", False):
        app.state.server_load = 0
        app.add_middleware(ServerLoadMiddleware)
    for middleware in getattr(args, "middleware", None) or ():
        _add_user_middleware(app, middleware)
    # Added last, so outermost: CORS headers reach the browser on errors (401, 500 too).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
        allow_credentials=getattr(args, "allow_credentials", False),
    )
    return app


class RequestIdHeaderMiddleware(HTTPMiddleware):
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own
    header or a new id, which is then put on the request too so that the generation
    endpoints use it as the request's id (in logs, aborts, errors)."""

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        headers = list(scope.get("headers") or [])
        request_id = dict(headers).get(b"x-request-id")
        if not request_id:
            request_id = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*headers, (b"x-request-id", request_id)]}

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id)]}  # fmt: skip
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_server_socket(host: str | None, port: int, uds: str | None = None) -> socket.socket:
    """A socket bound to (host, port), or with `uds` (--uds) to that Unix socket path (a
    stale socket file there is replaced), not yet listening (uvicorn listens once the engine
    is ready). Raises ValueError naming the address if it cannot be bound (a port in use)."""
    if uds is not None:
        return _unix_server_socket(uds)
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on connections whose socket says TCP, and accepted connections inherit the listening
    # socket's protocol number. With Nagle on, a stream's first chunk waited for the client's
    # delayed ACK of the response headers: 20 ms more TTFT for a client that delays it
    # (BENCHMARKS.md).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        sock.close()
        reason = getattr(e, "strerror", None) or e
        raise ValueError(f"cannot listen on {host}:{port}: {reason} (pick another --port)") from e
    return sock


def _unix_server_socket(path: str) -> socket.socket:
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ValueError(f"--uds {path!r} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on the Unix socket {path!r}: {e.strerror or e}") from e
    return sock


def close_server_socket(sock: socket.socket, uds: str | None = None) -> None:
    """Close a socket of `create_server_socket` (uvicorn may have closed it already), and
    remove the Unix socket file `uds`."""
    sock.close()
    _remove_socket_file(uds)


def _remove_socket_file(path: str | None) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _AccessLogFilter(logging.Filter):
    """--disable-access-log-for-endpoints: no access-log line for these paths (a comma list;
    the query string is not compared)."""

    def __init__(self, paths: str) -> None:
        super().__init__()
        self.paths = {p.strip() for p in paths.split(",") if p.strip()}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?", 1)[0] if len(args) > 2 else None
        return path not in self.paths


def checked_engine_config(args: argparse.Namespace) -> Any:
    """The engine's config from the flags (cheap), with what else the flags alone decide
    checked, before the port opens or an engine starts: a bad value is a ValueError naming
    it, not a traceback out of uvicorn's start-up."""
    from pagedllm.engine.arg_utils import EngineArgs

    config = EngineArgs.from_cli_args(args).create_engine_config()  # the reasoning parser too
    ServingOptions.from_args(args)
    return config


def run_server(
    args: argparse.Namespace,
    sock: socket.socket | None = None,
    client_config: ClientConfig | None = None,
    start_gate: StartGate | None = None,
) -> int:
    """Serve until SIGTERM / Ctrl-C, or until the engine dies; the engine process is stopped
    before this returns the exit status (EXIT_CODE_ENGINE_DEAD after an engine death).
    `sock`: a bound socket to serve on, the caller's (several API server processes share
    one); default: one bound here to --host / --port. `client_config` as in `build_app`;
    `start_gate`: the siblings' (api_server_procs.py), to start accepting together."""
    import uvicorn

    # A server that builds its engine checks its flags first (its lifespan takes the config).
    engine_config = checked_engine_config(args) if client_config is None else None
    app = build_app(args, client_config=client_config, engine_config=engine_config)
    own_sock = sock is None
    if sock is None:
        sock = create_server_socket(args.host, args.port, getattr(args, "uds", None))
    config = uvicorn.Config(
        app,
        host=args.host or "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    quiet = getattr(args, "disable_access_log_for_endpoints", None)
    if quiet:
        logging.getLogger("uvicorn.access").addFilter(_AccessLogFilter(quiet))
    where = f"unix:{args.uds}" if getattr(args, "uds", None) else f"{config.host}:{args.port}"
    logger.info("Starting the OpenAI-compatible server on %s", where)
    server = uvicorn.Server(config)
    app.state.request_shutdown = lambda: setattr(server, "should_exit", True)
    app.state.server_should_exit = lambda: server.should_exit
    app.state.listen_socket = sock
    app.state.start_gate = start_gate
    app.state.unix_socket_path = getattr(args, "uds", None) if own_sock else None
    try:
        server.run(sockets=[sock])
    finally:
        if own_sock:
            close_server_socket(sock, getattr(args, "uds", None))
    return EXIT_CODE_ENGINE_DEAD if getattr(app.state, "engine_dead_exit", False) else 0


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
    )
    parser = argparse.ArgumentParser(description="pagedllm OpenAI-compatible server")
    parser.add_argument("--model", required=True, help="Local checkpoint directory.")
    make_arg_parser(parser)
    argv = expand_config_file(parser, list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if args.headless or args.api_server_count != 1:
        parser.error("--headless and --api-server-count need `pagedllm serve`")
    try:
        status = run_server(args)
    except ValueError as e:  # bad flags, found before anything started
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(status)


if __name__ == "__main__":
    main()
