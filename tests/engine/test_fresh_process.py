"""`LLM` in a fresh interpreter, as a user's script runs it: the engine core built in this
process loads a Llama-3-rope checkpoint (whose rope tables import transformers while the
tokenizer would be loading), and a script that exits without `shutdown()` stops its engine
quietly, with no engine death reported."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize("multiprocessing", ["0", "1"])
def test_script_runs_and_exits_quietly(tiny_llama_dir, multiprocessing):
    env = {**os.environ, "PAGEDLLM_ENABLE_MULTIPROCESSING": multiprocessing}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_llama_dir],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "TOKENS 4" in proc.stdout, log
    for alarm in ("Traceback", "fatal error", "is dead", "ERROR"):
        assert alarm not in log, log
