"""A `pagedllm serve` child process a benchmark owns: a free loopback port, ready when
`/health` answers 200, stopped (SIGTERM, then SIGKILL; its engines go with it) when the
`with` block ends, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from pagedllm.spawn import get_open_port


class ServerProcess:
    """`pagedllm serve [MODEL] --host 127.0.0.1 --port <free> *serve_args` (no MODEL: the
    serve args name it, e.g. in a --config file), output to `log` (a file object; default:
    discarded), environment `env` (default: this process's)."""

    def __init__(
        self,
        model: str | None,
        serve_args: list[str],
        log: Any = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve"]
        cmd += [model] if model else []
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(
            cmd,
            env=env if env is not None else dict(os.environ),
            stdout=log if log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float | None = None) -> None:
        wait_healthy(self.url, self.proc, self.ready_timeout_s if timeout_s is None else timeout_s)

    def stop(self) -> None:
        """Idempotent."""
        stop_process(self.proc)

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    """Poll `url`/health until it answers 200; RuntimeError if `proc` exits first,
    TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f}s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; idempotent."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
