"""Server and engine-process lifetime: a killed engine makes the server answer 503 at once
(health and requests), and SIGTERM to the server leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.entrypoints.conftest import RemoteServer, child_pids, pid_alive

ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", str(2 << 20)]


def test_engine_death_then_sigterm(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, ARGS) as server:
        body = {"prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        engines = child_pids(server.proc.pid)
        assert engines, "no engine process found"
        # An in-flight stream must end with an error event instead of hanging.
        stream_body = {**body, "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=stream_body, timeout=30
        ) as r:
            lines = r.iter_lines()
            next(lines)
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
        assert time.monotonic() - t0 < 5
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"

        t0 = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert time.monotonic() - t0 < 5

        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=30)
        assert not any(pid_alive(p) for p in engines)
        assert child_pids(server.proc.pid) == []


def test_sigterm_stops_server_and_engine(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, ARGS) as server:
        engines = child_pids(server.proc.pid)
        assert engines
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) is not None
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in engines):
            assert time.monotonic() < deadline, "engine process outlived the server"
            time.sleep(0.1)
