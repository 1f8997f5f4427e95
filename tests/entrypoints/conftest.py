"""A live `pagedllm serve` in a subprocess on a free port, owned by whoever creates it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    result = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            result.append(int(entry))
    return result


def descendant_pids(pid: int) -> list[int]:
    """Every live process under `pid` (children, their children, ...)."""
    found, frontier = [], [pid]
    while frontier:
        children = child_pids(frontier.pop())
        found += children
        frontier += children
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class RemoteServer:
    """`pagedllm serve MODEL ARGS` on 127.0.0.1:<free port>. `stop()` (SIGTERM, then SIGKILL)
    is idempotent; use as a context manager so the process never outlives its test."""

    def __init__(
        self,
        model: str,
        args: list[str],
        timeout: float = 240.0,
        own_group: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`own_group`: the server leads its own process group with Ctrl-C's default action,
        as a terminal's foreground job (then `os.killpg(proc.pid, SIGINT)` is a Ctrl-C).
        `env`: variables set for the server on top of this process's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pagedllm-serve-", suffix=".log")
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        env.setdefault("PAGEDLLM_LOG_STATS_INTERVAL", "2")
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=own_group,
            preexec_fn=_default_sigint if own_group else None,
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        from pagedllm.benchmarks.server_process import wait_healthy

        try:
            wait_healthy(self.url, self.proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.logs()}") from None

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stream_chat_chunks(url: str, body: dict) -> list:
    """POST a streamed chat request and return its chunks, each validated strictly as the
    SDK's `ChatCompletionChunk` (the `object` field included)."""
    from openai.types.chat import ChatCompletionChunk

    chunks = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(ChatCompletionChunk.model_validate_json(line[6:], strict=True))
    return chunks
