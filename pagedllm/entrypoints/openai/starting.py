"""What the server's port answers while the engine loads: a minimal HTTP responder on the
server's own (already bound) socket, so that a readiness probe gets a clear 503 rather than a
refused connection. Every request gets 503 with `Connection: close`: `/ready` and `/health`
`{"ready": false, "status": "starting"}` (the health check is not 200 until the engine can
serve: supervisors and tests wait on it), anything else OpenAI's error shape. Once the engine
is up it stops and uvicorn takes the socket over; the app's `/ready` answers from then on.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

_STARTING = {"ready": False, "status": "starting"}
_ERROR = {
    "error": {
        "message": "the engine is starting; try again once /ready answers 200",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}
# How long one probe may take to send its request line and headers.
_READ_TIMEOUT_S = 5.0


def _response(path: str) -> bytes:
    body = json.dumps(_STARTING if path in ("/ready", "/health") else _ERROR).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
        parts = head.split(b" ", 2)
        path = parts[1].decode("latin-1").split("?", 1)[0] if len(parts) > 2 else "/"
        writer.write(_response(path))
        await writer.drain()
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass
    except ConnectionError:
        pass
    finally:
        writer.close()


@asynccontextmanager
async def answering_while_starting(sock: socket.socket | None) -> AsyncIterator[None]:
    """Answer 503 "starting" on `sock` (bound, not yet listening) for the block's duration.
    A duplicate of the socket is served, so closing this responder leaves `sock` open for
    uvicorn. None: nothing to do (an app served some other way)."""
    if sock is None:
        yield
        return
    own = sock.dup()
    server = await asyncio.start_server(_answer, sock=own)
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()
