"""Fixtures for benchmark tests: a tiny checkpoint, and a fake OpenAI streaming server whose
chunk timings are known."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from pagedllm.testing import make_demo_model

    return make_demo_model(str(tmp_path_factory.mktemp("bench-tiny")), preset="tiny", seed=0)


@dataclass
class FakeServer:
    """A streaming `/v1/completions` and `/v1/chat/completions` server: after `first_s`
    it sends the first chunk (chat: after a role-only chunk sent at once), then one chunk
    every `gap_s` until `max_tokens` chunks, then a usage-only chunk and `[DONE]`. A prompt
    equal to `[0]` gets an HTTP 400."""

    model_id: str
    first_s: float = 0.05
    gap_s: float = 0.02
    url: str = ""
    bodies: list[dict] = field(default_factory=list)
    # The Authorization header of every request (None when absent).
    authorizations: list[str | None] = field(default_factory=list)
    # Every generation request's headers (lower-case names).
    headers: list[dict[str, str]] = field(default_factory=list)


def _sse(obj: dict | str) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {text}\n\n".encode()


def _build_app(fake: FakeServer):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        fake.authorizations.append(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [{"id": fake.model_id, "object": "model"}]})

    async def generate(request):
        body = await request.json()
        fake.bodies.append(body)
        fake.authorizations.append(request.headers.get("authorization"))
        fake.headers.append(dict(request.headers))
        chat = request.url.path.endswith("/chat/completions")
        if body.get("prompt") == [0]:
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        n = body.get("max_completion_tokens") if chat else body.get("max_tokens")

        async def stream():
            if chat:  # a role announcement at once, as some servers send (not a token)
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                yield _sse({"id": "cmpl-1", "choices": [role]})
            await asyncio.sleep(fake.first_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(fake.gap_s)
                choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                if chat:
                    choice["delta"] = {"content": "x"}
                else:
                    choice["text"] = "x"
                yield _sse({"id": "cmpl-1", "choices": [choice]})
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            yield _sse({"id": "cmpl-1", "choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    routes = [
        Route("/v1/models", models),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
    ]
    return Starlette(routes=routes)


@pytest.fixture(scope="module")
def fake_server(tiny_model_dir):
    """A running `FakeServer` on a free loopback port (its model id is the tiny checkpoint,
    so the benchmark can load its tokenizer from it)."""
    import uvicorn

    fake = FakeServer(model_id=tiny_model_dir)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_build_app(fake), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the fake server did not start")
        time.sleep(0.02)
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()
