"""`LLM` in a fresh interpreter, as a user's script runs it: the engine core built in this
process loads a Llama-3-rope checkpoint (whose rope tables import transformers while the
tokenizer would be loading), and a script that exits without `shutdown()` stops its engine
quietly, with no engine death reported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="float32")
    out = llm.generate(["hello there"], SamplingParams(max_tokens=4), use_tqdm=False)
    print("TOKENS", len(out[0].outputs[0].token_ids))
    """
)


def _run_script(script: str, model: str, **env: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter (argv[1] = model) with `env` added; the finished
    process, once it has exited cleanly and logged no alarm."""
    proc = subprocess.run(
        [sys.executable, "-c", script, model],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=180,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    for alarm in ("Traceback", "fatal error", "is dead", "ERROR"):
        assert alarm not in log, log
    return proc


@pytest.mark.parametrize("multiprocessing", ["0", "1"])
def test_script_runs_and_exits_quietly(tiny_llama_dir, multiprocessing):
    out = _run_script(SCRIPT, tiny_llama_dir, PAGEDLLM_ENABLE_MULTIPROCESSING=multiprocessing)
    assert "TOKENS 4" in out.stdout, out.stdout


FORK_SCRIPT = textwrap.dedent(
    """
    import logging, sys, torch
    from pagedllm import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO, format="FRONT %(message)s")
    # A multi-threaded op first: the main thread now holds an OpenMP thread pool, which a
    # child forked from it could not use (its first parallel region would hang).
    x = torch.randn(512, 512)
    torch.set_num_threads(2)
    (x @ x).sum()
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0)
    # A forked engine runs this very command line; a spawned one its own interpreter's.
    with open(f"/proc/{llm.llm_engine.engine_core.engine_pid}/cmdline", "rb") as f:
        spawned = f.read() != open("/proc/self/cmdline", "rb").read()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    out = llm.generate(prompts, params, use_tqdm=False)
    print("SPAWNED", spawned)
    print("TOKENS", [list(o.outputs[0].token_ids) for o in out])
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="engines fork only on Linux")
def test_forked_engine_matches_a_spawned_one(tiny_llama_dir):
    """`auto` forks the engine from a script's single thread, even after torch ran OpenMP
    regions there (the fork is made from a fresh thread) and set up logging; the forked
    engine logs under its own label and its greedy tokens are the spawned one's."""
    results = {}
    for method in ("auto", "spawn"):
        out = _run_script(
            FORK_SCRIPT,
            tiny_llama_dir,
            PAGEDLLM_ENGINE_MULTIPROC_METHOD=method,
            PAGEDLLM_ENABLE_MULTIPROCESSING="1",
        )
        lines = out.stdout.splitlines()
        results[method] = dict(line.split(" ", 1) for line in lines if " " in line)
        # The engine's own log label, not the front end's format it was forked with.
        assert re.search(r"\[EngineCore_DP0 pid=\d+\] EngineCore ready", out.stderr), out.stderr
        assert "FRONT EngineCore ready" not in out.stderr, out.stderr
    assert results["auto"]["SPAWNED"] == "False"
    assert results["spawn"]["SPAWNED"] == "True"
    assert results["auto"]["TOKENS"] == results["spawn"]["TOKENS"]


def test_engine_start_method(monkeypatch):
    import threading

    from pagedllm.spawn import ENGINE_METHOD_ENV, engine_start_method

    monkeypatch.delenv(ENGINE_METHOD_ENV, raising=False)
    alone = threading.active_count() == 1
    expected = "fork" if sys.platform == "linux" and alone else "spawn"
    assert engine_start_method("cpu") == expected
    assert engine_start_method("cuda") == "spawn"  # CUDA cannot be used in a forked child
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:  # another Python thread could be caught mid-import by the fork
        assert engine_start_method("cpu") == "spawn"
    finally:
        stop.set()
        thread.join()
    monkeypatch.setenv(ENGINE_METHOD_ENV, "spawn")
    assert engine_start_method("cpu") == "spawn"
    monkeypatch.setenv(ENGINE_METHOD_ENV, "fork")
    assert engine_start_method("cuda") == "fork"
    monkeypatch.setenv(ENGINE_METHOD_ENV, "forks")
    with pytest.raises(ValueError, match="PAGEDLLM_ENGINE_MULTIPROC_METHOD='forks'"):
        engine_start_method("cpu")
