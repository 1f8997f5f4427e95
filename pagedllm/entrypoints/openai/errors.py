"""Every error the OpenAI-compatible server sends, in OpenAI's shape:
`{"error": {"message": str, "type": str, "param": str | None, "code": int}}`.

- `OpenAIError`: raise it from a handler (or while the request body is read) with its HTTP
  status; the app answers it as is.
- `error_response`: the JSON response for one. Non-ASCII text is escaped, so a message that
  echoes bad input (a lone surrogate, say) can never fail to encode.
- `register_error_handlers(app)`: FastAPI's own errors (request validation -> 400; 404, 405 and
  any other `HTTPException`; an error raised while the body was read) and `EngineDeadError`
  (503) in the same shape.
- `CatchAllMiddleware`: any other exception becomes a 500 whose message names a request id;
  the traceback goes to the server log under that id, never to the client.

Inside a stream that already started, handlers send the same body as a `data:` event.
"""

from __future__ import annotations

import json
import logging
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.protocol import ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.CONFLICT: "ConflictError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape with HTTP status `status_code`; `param` names the
    request field at fault, where there is one."""

    def __init__(
        self,
        message: str,
        status_code: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param
        try:
            default_type = _ERROR_TYPES.get(HTTPStatus(self.status_code), "Error")
        except ValueError:  # a status http.HTTPStatus does not know (499)
            default_type = "Error"
        self.err_type = err_type or default_type

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status_code,
            }
        }

    def to_response(self) -> ErrorResponse:
        """The pydantic `ErrorResponse` (for a stream's `data:` event)."""
        return ErrorResponse.model_validate(self.to_dict())

    @classmethod
    def from_exception(cls, e: BaseException) -> OpenAIError:
        """ValueError -> 400, dead engine -> 503, anything else -> 500."""
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, ValueError):
            return cls(str(e), HTTPStatus.BAD_REQUEST)
        if isinstance(e, EngineDeadError):
            return cls(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
        return cls(f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """`error` as a JSON response (ASCII-only body: any text encodes)."""
    return Response(
        json.dumps(error.to_dict(), ensure_ascii=True),
        status_code=error.status_code,
        media_type="application/json",
        headers=headers,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the first field at fault, from pydantic's error list."""
    parts: list[str] = []
    param = None
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            where = err.get("loc", ("body", "?"))[-1]
            detail = (err.get("ctx") or {}).get("error", "malformed")
            return f"the request body is not valid JSON: {detail} (at character {where})", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "missing" and not loc:
            return "the request needs a JSON object body", None
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def register_error_handlers(app: FastAPI) -> None:
    """Answer FastAPI's own errors and `EngineDeadError` in OpenAI's shape."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(OpenAIError(message, HTTPStatus.BAD_REQUEST, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI turns any error raised while it reads the body into a bare 400; the
        # server's body checks raise OpenAIError, which is answered as itself.
        if isinstance(exc.__cause__, OpenAIError):
            return error_response(exc.__cause__)
        path = request.url.path
        if exc.status_code == HTTPStatus.NOT_FOUND:
            message = f"Not found: {request.method} {path}"
        elif exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"Method {request.method} is not allowed on {path} (allowed: {allowed})"
        elif exc.__cause__ is not None:
            message = f"could not read the request body ({type(exc.__cause__).__name__})"
        else:
            message = str(exc.detail)
        return error_response(OpenAIError(message, exc.status_code), headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(OpenAIError.from_exception(exc))


class HTTPMiddleware:
    """A pure ASGI middleware's frame: other scopes (lifespan) pass through, `handle` gets
    the HTTP ones."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        raise NotImplementedError


class CatchAllMiddleware(HTTPMiddleware):
    """Outermost: an exception nothing else handled becomes a 500 in OpenAI's shape that
    names a request id (the `X-Request-Id` header, or a fresh one); the log gets that id with
    the traceback. A response already started is left to end where it broke."""

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            headers = dict(scope.get("headers") or [])
            request_id = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
            logger.exception(
                "Internal error in %s %s (request id %s)",
                scope.get("method"),
                scope.get("path"),
                request_id,
            )
            if started:
                return
            error = OpenAIError(
                f"Internal server error (request id {request_id}); the server log has the details",
                HTTPStatus.INTERNAL_SERVER_ERROR,
            )
            await error_response(error)(scope, receive, send)
