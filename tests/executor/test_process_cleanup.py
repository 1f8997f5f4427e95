"""No process outlives a multi-rank engine: Ctrl-C, SIGTERM to the script, or a crash of the
engine's process, on both backends. A script runs `LLM(..., tensor_parallel_size=2)` in a loop;
the test signals it and waits for every process under it (engine, fork server, workers, a local
Ray instance) to be gone. With `mp` the engine core runs in the script itself (one process start
less); with `ray` in its own process, as by default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.entrypoints.conftest import REPO_ROOT, cmdline, descendant_pids, pid_alive

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = """
import sys
from pagedllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory_bytes=2 << 20, tensor_parallel_size=2,
          distributed_executor_backend=sys.argv[2])
print("READY", flush=True)
while True:
    llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                 SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(model_dir: str, backend: str) -> tuple[subprocess.Popen, list[int]]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "1" if backend == "ray" else "0"
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, model_dir, backend],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # its own process group, as a terminal gives it
        # and Ctrl-C's default action, as a terminal's shell gives a foreground job (a suite
        # started in the background, `make test &`, inherits SIGINT ignored).
        preexec_fn=_default_sigint,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "READY" in line:
            break
    else:
        raise AssertionError("".join(lines[-40:]))
    time.sleep(1.0)  # mid-generation
    return proc, descendant_pids(proc.pid)


def _assert_all_gone(procs: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in procs):
        left = [cmdline(p)[:80] for p in procs if pid_alive(p)]
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "backend, how",
    [("mp", "ctrl-c"), ("mp", "engine-crash"), ("ray", "sigterm")],
)
def test_nothing_left_behind(tiny_llama_dir, backend, how):
    if backend == "ray":
        pytest.importorskip("ray")
    proc, procs = _start(tiny_llama_dir, backend)
    try:
        assert len(procs) >= 3  # workers (and their fork server, or Ray's processes)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends the whole group
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)  # the script dies without cleaning up
        else:
            proc.kill()  # the engine's process crashes: its workers must follow
        _assert_all_gone([p for p in procs if p != proc.pid], timeout_s=30)
    finally:
        proc.kill()
        proc.wait()
