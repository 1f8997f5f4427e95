"""Server and engine-process lifetime: a killed engine fails in-flight requests at once and
the server exits non-zero (or, with --keep-alive-on-engine-death, answers 503 and stops
logging stale stats); SIGTERM leaves no process behind; a port in use fails before the engine
loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.entrypoints.conftest import REPO_ROOT, RemoteServer, child_pids, free_port, pid_alive

ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", str(2 << 20)]
STATS_LINE = "Avg prompt throughput"


def _kill_engine_during_a_stream(server) -> list[int]:
    """Kill the engine while a stream runs; the stream must end with an error event and
    [DONE] at once. Returns the killed engine pids."""
    body = {"prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    engines = child_pids(server.proc.pid)
    assert engines, "no engine process found"
    stream_body = {**body, "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream_body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest = [line for line in lines if line]
    assert time.monotonic() - t0 < 5
    assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"
    return engines


def test_engine_death_exits_the_server(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, ARGS) as server:
        engines = _kill_engine_during_a_stream(server)
        assert server.proc.wait(timeout=60) == 1, server.logs()
        assert "the server exits with status 1" in server.logs()
        assert not any(pid_alive(p) for p in engines)


def test_engine_death_keep_alive_then_sigterm(tiny_llama_dir):
    args = [*ARGS, "--keep-alive-on-engine-death"]
    with RemoteServer(tiny_llama_dir, args) as server:
        engines = _kill_engine_during_a_stream(server)
        stats_lines = server.logs().count(STATS_LINE)

        t0 = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        body = {"prompt": "hello", "max_tokens": 2}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert time.monotonic() - t0 < 5

        # No stale stats after the death (the fixture logs them every 2 s).
        time.sleep(5)
        assert server.logs().count(STATS_LINE) == stats_lines, server.logs()
        assert server.proc.poll() is None  # still up

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


def test_port_in_use_fails_before_the_engine_loads(tiny_llama_dir):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *ARGS]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "EngineCore" not in done.stdout + done.stderr  # failed before starting it


@pytest.mark.parametrize(
    "module", ["pagedllm.entrypoints.cli.main", "pagedllm.entrypoints.openai.api_server"]
)
def test_missing_model_fails_before_the_server_starts(tmp_path, module):
    """A model path that does not exist (or a hub id: there is no network) is one line on
    stderr and exit status 2, before uvicorn or an engine starts (not a traceback out of the
    server's start-up)."""
    missing = str(tmp_path / "no-such-model")
    cmd = [sys.executable, "-m", module]
    cmd += ["serve", missing] if module.endswith("cli.main") else ["--model", missing]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"error: model={missing!r} is not an existing local directory" in done.stderr
    assert "Traceback" not in done.stderr and "Started server" not in done.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dtype", "float8"], "dtype='float8' is not supported"),
        (["--kv-cache-dtype", "fp8_inc"], "kv_cache_dtype='fp8_inc' is not supported"),
        (["--reasoning-parser", "nope"], "reasoning_parser='nope' is not available"),
        (["--chat-template", "/no/such/template.jinja"], "is neither a file nor a Jinja template"),
        (["--port", "99999"], "cannot listen on 127.0.0.1:99999"),
        (["--middleware", "no_such_module.Thing"], "--middleware 'no_such_module.Thing' cannot"),
        (["--middleware", "os.sep"], "is neither a class nor an async function"),
        (["--uds", "/no/such/dir/x.sock"], "cannot listen on the Unix socket '/no/such/dir"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
    ],
)
def test_bad_flags_fail_before_the_server_starts(tiny_llama_dir, flags, message):
    """Flags the server could only refuse in its start-up are checked first: one error line,
    exit status 2, no traceback, no engine started."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_llama_dir]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port()), *ARGS, *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "EngineCore" not in done.stdout + done.stderr
