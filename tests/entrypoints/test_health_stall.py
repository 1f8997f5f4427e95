"""`/health` tells the truth: a live server whose engine is wedged on purpose (the test-only
PAGEDLLM_TEST_BLOCK_STEP_FILE hook) turns 503 with the reason once no step finished for
`--stall-timeout-s`, says so in `vllm:engine_stalled` and in its log, and recovers when the
step is released; `/ready` follows, and is 503 "starting" while the engine loads. `engine_health`'s data-parallel verdicts and the front
end's missing-heartbeat rule are checked without processes."""

from __future__ import annotations

import logging
import threading
import time
import types

import httpx
import pytest

from pagedllm.engine import EngineHealth
from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.engine.stall import BLOCK_STEP_FILE_ENV
from pagedllm.entrypoints.openai.api_server import engine_health
from tests.entrypoints.conftest import RemoteServer

STALL_TIMEOUT_S = 2.0
ARGS = [
    "--dtype", "float32",
    "--max-model-len", "256",
    "--kv-cache-memory-bytes", str(2 << 20),
    "--stall-timeout-s", str(STALL_TIMEOUT_S),
]  # fmt: skip


def _stalled_gauge(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:engine_stalled{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:engine_stalled series")


def _wait_for_health(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/health", timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


@pytest.mark.slow
def test_wedged_engine_turns_health_503_and_recovers(tiny_llama_dir, tmp_path, monkeypatch):
    block = tmp_path / "block-step"
    monkeypatch.setenv(BLOCK_STEP_FILE_ENV, str(block))
    with RemoteServer(tiny_llama_dir, ARGS) as server:
        url = server.url
        assert httpx.get(f"{url}/ready", timeout=10).json() == {"ready": True}
        block.touch()
        result: dict = {}

        def complete() -> None:
            body = {"prompt": "stuck in the queue", "max_tokens": 4, "ignore_eos": True}
            result["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=complete)
        thread.start()
        try:
            # Idle past the timeout is not a stall; a request waiting on a wedged step is,
            # once the timeout has passed (plus a heartbeat, plus slack for a loaded box).
            r = _wait_for_health(url, 503, timeout=STALL_TIMEOUT_S + 15)
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["status"] == "stalled"
            assert body["error"]["code"] == 503
            reason = body["error"]["message"]
            assert "engine 0 stalled" in reason and "--stall-timeout-s" in reason
            assert "1 waiting" in reason and "(WAITING" in reason
            assert httpx.get(f"{url}/ready", timeout=10).status_code == 503
            assert _stalled_gauge(url) == 1.0
            assert "r" not in result  # the request is still stuck
        finally:
            block.unlink()
        r = _wait_for_health(url, 200, timeout=STALL_TIMEOUT_S + 15)
        assert r.status_code == 200, r.text
        thread.join(timeout=60)
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["usage"]["completion_tokens"] == 4
        assert _stalled_gauge(url) == 0.0
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
        logs = server.logs()
    # The log says what was in flight, once, and that it recovered.
    assert logs.count("engine 0 stalled: no step finished") == 1, logs
    assert "recovered" in logs


class _ProbedServer(RemoteServer):
    """A RemoteServer whose start-up is watched through `/ready` (what each answer was, in
    order) and, while it says "starting", through `/health` and `/v1/models` too."""

    def _wait_ready(self, timeout: float) -> None:
        self.ready_answers: list[tuple[int, dict]] = []
        self.starting_answers: dict[str, tuple[int, dict]] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                r = httpx.get(f"{self.url}/ready", timeout=2)
            except httpx.HTTPError:  # not listening yet (the interpreter still imports)
                time.sleep(0.05)
                continue
            answer = (r.status_code, r.json())
            if not self.ready_answers or self.ready_answers[-1] != answer:
                self.ready_answers.append(answer)
            if r.status_code == 200:
                return
            if not self.starting_answers:
                for path in ("/health", "/v1/models"):
                    other = httpx.get(f"{self.url}{path}", timeout=2)
                    self.starting_answers[path] = (other.status_code, other.json())
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.logs()}")


@pytest.mark.slow
def test_ready_is_503_while_the_engine_loads_then_200(tiny_llama_dir):
    with _ProbedServer(tiny_llama_dir, ARGS) as server:
        assert server.ready_answers == [
            (503, {"ready": False, "status": "starting"}),
            (200, {"ready": True}),
        ]
        assert server.starting_answers["/health"] == (503, {"ready": False, "status": "starting"})
        status, body = server.starting_answers["/v1/models"]
        assert status == 503 and body["error"]["code"] == 503
        assert "starting" in body["error"]["message"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


class _FakeEngine:
    def __init__(self, num_engines: int, dead: dict, stalled: dict) -> None:
        self.engine_core = types.SimpleNamespace(num_engines=num_engines)
        self.dead_engines = dead
        self.stalled_engines = stalled


@pytest.mark.parametrize(
    ("num_engines", "dead", "stalled", "status", "verdict"),
    [
        (1, {}, {}, 200, None),
        (1, {}, {0: "engine 0 stalled: x"}, 503, "stalled"),
        (2, {}, {1: "engine 1 stalled: x"}, 200, "degraded"),  # engine 0 serves on
        (2, {}, {0: "a", 1: "b"}, 503, "stalled"),
        (2, {0: "killed"}, {1: "engine 1 stalled: x"}, 503, "stalled"),  # none left to serve
        (2, {0: "killed"}, {}, 200, "degraded"),
    ],
)
def test_health_verdicts_per_engine(num_engines, dead, stalled, status, verdict):
    code, body = engine_health(_FakeEngine(num_engines, dead, stalled))
    assert code == status
    if verdict is None:
        assert body is None
        return
    assert body["status"] == verdict
    assert body.get("stalled_engines", {}) == {str(r): why for r, why in stalled.items()}
    if verdict == "stalled":
        assert all(why in body["error"]["message"] for why in stalled.values())
    else:
        assert body.get("dead_engines", {}) == {str(r): why for r, why in dead.items()}


def _client_state(num_engines: int = 2) -> AsyncMPClient:
    """An AsyncMPClient's stall bookkeeping only (no sockets, no engines)."""
    client = AsyncMPClient.__new__(AsyncMPClient)
    client._stall_timeout_s = STALL_TIMEOUT_S
    client._dead_error = None
    client._dead_engines = {}
    client.num_engines = num_engines
    client._engine_health = {}
    now = time.monotonic()
    client._last_heard = {rank: now for rank in range(num_engines)}
    client._silent = set()
    return client


def test_client_counts_a_silent_engine_as_stalled(caplog):
    client = _client_state()
    client._last_heard[1] -= 60
    assert client.stalled_engines == {}, "an engine that never sent a heartbeat sends none"
    client._engine_health[0] = EngineHealth(stalled_for_s=3.0, reason="engine 0 stalled: y")
    assert client.stalled_engines == {0: "engine 0 stalled: y"}
    client._engine_health[0] = EngineHealth()
    client._engine_health[1] = EngineHealth()  # its last heartbeat, a minute ago: frozen
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.core_client"):
        stalled = client.stalled_engines
        assert client.stalled_engines == stalled  # polled again: logged once
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "EngineCore 1 sends no heartbeats" in warnings[0].message
        client._last_heard[1] = time.monotonic()  # heard from again
        assert client.stalled_engines == {}
        assert "EngineCore 1 is heard from again" in caplog.records[-1].message
        client._last_heard[1] -= 60
    assert list(stalled) == [1] and "no heartbeat" in stalled[1]
    client._dead_engines[1] = "gone"  # a dead engine is dead, not stalled
    assert client.stalled_engines == {}
    client._stall_timeout_s = 0  # off
    client._last_heard[0] -= 60
    assert client.stalled_engines == {}
