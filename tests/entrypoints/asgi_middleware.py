"""Middleware for `pagedllm serve --middleware` in test_serve_transport.py: one ASGI class and
one `async (request, call_next)` function, each marking the responses it saw."""

from __future__ import annotations

from typing import Any


class MarkClass:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def marked(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-mark-class", b"1")]}
            await send(message)

        await self.app(scope, receive, marked if scope["type"] == "http" else send)


async def mark_function(request: Any, call_next: Any) -> Any:
    response = await call_next(request)
    response.headers["x-mark-function"] = "1"
    return response
