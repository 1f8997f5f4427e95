"""The OpenAI-compatible HTTP server: a FastAPI app around one `AsyncLLM`.

`build_app(args)` makes the app; its lifespan starts the AsyncLLM (and with it the engine
process) before uvicorn binds the port, and shuts it down when uvicorn stops (SIGTERM,
Ctrl-C), so no engine process outlives the server. `run_server(args)` runs it with uvicorn.

Errors are OpenAI-shaped (`{"error": {message, type, param, code}}`): 400 for invalid input,
401 for a missing or wrong API key on `/v1/*`, 404 for an unknown model, 503 while the engine
is dead. `python -m pagedllm.entrypoints.openai.api_server --model DIR` also runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import sys
from collections.abc import AsyncGenerator, Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.cli_args import (
    expand_config_file,
    load_chat_template,
    log_requests_enabled,
    make_arg_parser,
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
from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)


def _error_json(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=error.status_code)


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
                await _error_json(error)(scope, receive, send)
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


def _respond(result: Any) -> Response:
    if result is None:  # client disconnected
        return Response(status_code=499)
    if isinstance(result, AsyncGenerator):
        return StreamingResponse(result, media_type="text/event-stream")
    if isinstance(result, dict):
        return JSONResponse(result)
    return JSONResponse(result.model_dump(exclude_unset=False))


def _register_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        try:
            await raw_request.app.state.engine.check_health()
        except EngineDeadError as e:
            return _error_json(OpenAIError.from_exception(e))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        from pagedllm import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics(raw_request: Request) -> Response:
        prometheus = raw_request.app.state.engine.prometheus
        body = prometheus.render() if prometheus is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw_request: Request) -> Response:
        """Forget every cached prefix (vLLM's endpoint, e.g. between benchmark runs); 409
        while requests still hold KV blocks."""
        if not await raw_request.app.state.engine.reset_prefix_cache():
            return _error_json(
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
        coro = handler.create_completion(request, raw_request.headers.get("X-Request-Id"))
        return _respond(await with_cancellation(coro, raw_request))

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, raw_request: Request) -> Response:
        handler: OpenAIServingChat = raw_request.app.state.serving_chat
        if request.chat_template is None:
            request.chat_template = raw_request.app.state.chat_template
        coro = handler.create_chat_completion(request, raw_request.headers.get("X-Request-Id"))
        return _respond(await with_cancellation(coro, raw_request))

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        handler: OpenAIServingResponses = raw_request.app.state.serving_responses
        coro = handler.create_response(request, raw_request.headers.get("X-Request-Id"))
        return _respond(await with_cancellation(coro, raw_request))

    @app.post("/tokenize")
    async def tokenize(
        request: TokenizeChatRequest | TokenizeCompletionRequest, raw_request: Request
    ) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
        if isinstance(request, TokenizeChatRequest) and request.chat_template is None:
            request.chat_template = raw_request.app.state.chat_template
        return JSONResponse((await handler.create_tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
        return JSONResponse((await handler.create_detokenize(request)).model_dump())


def _register_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_json(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts, param = [], None
        for err in errors[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        message = "; ".join(parts) or "invalid request"
        return _error_json(OpenAIError(message, HTTPStatus.BAD_REQUEST, param=param))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_json(OpenAIError.from_exception(exc))


def init_app_state(app: FastAPI, engine: AsyncLLM, args: argparse.Namespace) -> None:
    """Attach the engine and the endpoint handlers to `app.state`."""
    mc = engine.model_config
    names = mc.served_model_names
    state = app.state
    state.engine = engine
    state.served_model_names = names
    state.model_path = mc.model
    state.max_model_len = mc.max_model_len
    state.chat_template = load_chat_template(getattr(args, "chat_template", None))
    state.serving_completion = OpenAIServingCompletion(engine, names)
    state.serving_chat = OpenAIServingChat(
        engine,
        names,
        enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=engine.config.structured_outputs_config.reasoning_parser,
    )
    state.serving_responses = OpenAIServingResponses(state.serving_chat, state.chat_template)
    state.serving_tokenization = OpenAIServingTokenization(engine, names)


def build_app(args: argparse.Namespace, engine: AsyncLLM | None = None) -> FastAPI:
    """The FastAPI app. Without `engine`, the lifespan builds one from `args` and owns it
    (shuts it down on exit); a given engine stays the caller's."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        owned = engine is None
        if owned:
            from pagedllm.engine.arg_utils import EngineArgs

            engine_args = EngineArgs.from_cli_args(args)
            the_engine = AsyncLLM.from_engine_args(
                engine_args, log_requests=log_requests_enabled(args)
            )
        else:
            the_engine = engine
        try:
            init_app_state(app, the_engine, args)
            yield
        finally:
            if owned:
                logger.info("Shutting down the engine")
                the_engine.shutdown()

    app = FastAPI(lifespan=lifespan, root_path=getattr(args, "root_path", None) or "")
    _register_routes(app)
    _register_error_handlers(app)
    if getattr(args, "api_key", None):
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    # Added last, so outermost: CORS headers reach the browser on errors (401 too).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
        allow_credentials=getattr(args, "allow_credentials", False),
    )
    return app


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGTERM / Ctrl-C; the engine process is stopped before this returns."""
    import uvicorn

    app = build_app(args)
    config = uvicorn.Config(
        app,
        host=args.host or "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    logger.info("Starting the OpenAI-compatible server on %s:%d", config.host, args.port)
    uvicorn.Server(config).run()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    parser = argparse.ArgumentParser(description="pagedllm OpenAI-compatible server")
    parser.add_argument("--model", required=True, help="Local checkpoint directory.")
    make_arg_parser(parser)
    argv = expand_config_file(parser, list(sys.argv[1:] if argv is None else argv))
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
