"""vLLM's `serve` flags for how the server is reached and watched: --uds (a Unix socket; the
file is gone after the server stops), --middleware (a class and a function),
--enable-server-load-tracking (GET /load), --disable-access-log-for-endpoints,
--sse-keep-alive-interval (`_with_keep_alive`, unit-tested, and live) and --stream-interval;
and the TCP socket's connections sending small writes at once (Nagle's algorithm off)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from pagedllm.benchmarks.server_process import stop_process
from pagedllm.entrypoints.openai.api_server import _with_keep_alive, create_server_socket
from tests.entrypoints.conftest import REPO_ROOT

MODEL = "tiny"
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def uds_server(tiny_llama_dir):
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as log:
        path = os.path.join(tmp, "pagedllm.sock")
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama_dir,
               "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
               "--kv-cache-memory", str(4 << 20), "--uds", path,
               "--middleware", "tests.entrypoints.asgi_middleware.MarkClass",
               "--middleware", "tests.entrypoints.asgi_middleware.mark_function",
               "--enable-server-load-tracking", "--sse-keep-alive-interval", "1",
               "--disable-access-log-for-endpoints", "/health,/load",
               "--stream-interval", "3"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://x")
        try:
            deadline = time.monotonic() + 240
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, _read(log)
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            yield client, proc, path, log
        finally:
            client.close()
            stop_process(proc, 30)


def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")


def test_served_on_the_unix_socket_with_the_middleware(uds_server):
    client, _, _, _ = uds_server
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert r.headers["x-mark-class"] == "1" and r.headers["x-mark-function"] == "1"
    assert client.get("/nowhere").headers["x-mark-class"] == "1"  # errors pass them too


def test_load_counts_requests_in_flight(uds_server):
    client, _, _, _ = uds_server
    assert client.get("/load").json() == {"server_load": 0}
    # Far more than the socket buffers hold (~2 MB of logprobs): unread, the stream stays in
    # flight however fast the model is (its deltas may merge; the logprobs do not shrink).
    body = {**BODY, "n": 16, "max_tokens": 240, "logprobs": 20, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
        first = next(lines)
        assert r.status_code == 200 and first.startswith("data: {"), first
        assert client.get("/load").json() == {"server_load": 1}
        assert "data: [DONE]" in list(lines)
    assert client.get("/load").json() == {"server_load": 0}


def test_streams_with_an_interval_carry_the_whole_text(uds_server):
    client, _, _, _ = uds_server
    body = {**BODY, "max_tokens": 11, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == whole and 1 < len(texts) <= 5  # 1 + 3 + 3 + 3 + 1 at most


def test_access_log_leaves_out_the_listed_paths(uds_server):
    client, _, _, log = uds_server
    client.get("/health")
    client.get("/load")
    client.get("/v1/models")
    time.sleep(0.5)
    logs = _read(log)
    assert '"GET /v1/models HTTP/1.1" 200' in logs
    assert '"GET /health HTTP/1.1"' not in logs and '"GET /load HTTP/1.1"' not in logs


def test_the_socket_file_goes_with_the_server(tiny_llama_dir, uds_server):
    """(Last: it stops the module's server.)"""
    _, proc, path, _ = uds_server
    assert os.path.exists(path)
    stop_process(proc, 30)
    assert not os.path.exists(path)  # (uvicorn ends on the SIGTERM it re-raises: -15)


def test_keep_alive_comments_while_a_stream_is_idle():
    closed = []

    async def slow_events():
        try:
            for event in ("data: a\n\n", "data: b\n\n"):
                await asyncio.sleep(0.35)
                yield event
        finally:
            closed.append(True)

    async def collect(limit: int | None = None) -> list[str]:
        out = []
        stream = _with_keep_alive(slow_events(), 0.1)
        async for item in stream:
            out.append(item)
            if limit is not None and len(out) == limit:
                await stream.aclose()  # the client went away mid-stream
                break
        return out

    out = asyncio.run(collect())
    assert [e for e in out if e.startswith("data:")] == ["data: a\n\n", "data: b\n\n"]
    keep_alives = [e for e in out if e == ": keep-alive\n\n"]
    assert 4 <= len(keep_alives) <= 8 and out.index("data: a\n\n") >= 2
    assert closed == [True]
    closed.clear()
    assert asyncio.run(collect(limit=2)) == [": keep-alive\n\n"] * 2
    assert closed == [True]  # the pending event was cancelled and the source closed


def test_tcp_connections_send_small_writes_at_once():
    """The connections accepted on `create_server_socket`'s socket, served by asyncio as
    uvicorn serves them (`create_server(sock=...)`), have Nagle's algorithm off: with it on, a
    stream's first chunk waited for the client's delayed ACK of the response headers. asyncio
    sets TCP_NODELAY only where the socket's protocol number says TCP, which a socket made
    with the default protocol 0 (and every connection it accepts) does not."""

    async def accepted_nodelay() -> int:
        sock = create_server_socket("127.0.0.1", 0)
        found: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            found.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            try:
                return await asyncio.wait_for(found, 10)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
