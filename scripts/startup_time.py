"""Start-up of `LLM(model=...)`: wall time and CPU seconds of both processes, in fresh
interpreters.

    python scripts/startup_time.py --model DIR [--runs 5] [--llm-kwargs JSON]

Each run starts a new Python that imports pagedllm, builds `LLM(model=DIR, ...)` (the default
multiprocess engine) and reports, at the moment the constructor returns: wall seconds since
the interpreter started (the parent's clock, so interpreter start-up counts), the
constructor's own wall seconds (`llm_wall`, the issue's "LLM(...) ready"), the front end's
CPU seconds (all its threads) and the engine process's (read from /proc). CPU seconds do not
depend on how busy the machine is; wall time does, so read it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
kwargs = json.loads(sys.argv[2])
from pagedllm import LLM
t_import = time.process_time()
t_wall = time.perf_counter()
llm = LLM(model=sys.argv[1], **kwargs)
llm_wall = time.perf_counter() - t_wall
front = time.process_time()
pid = llm.llm_engine.engine_core.engine_pid
with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
engine = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
print("STARTUP " + json.dumps(
    {"llm_wall": llm_wall, "import_cpu": t_import, "front_cpu": front, "engine_cpu": engine}
))
sys.stdout.flush()
llm.llm_engine.shutdown()
"""


def run_once(model: str, kwargs: dict) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, model, json.dumps(kwargs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    result = None
    for line in proc.stdout:
        if line.startswith("STARTUP "):
            result = json.loads(line[len("STARTUP ") :])
            result["wall"] = time.perf_counter() - start
    proc.wait()
    if result is None:
        raise RuntimeError(f"the child exited with {proc.returncode} before it was ready")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llm-kwargs", default="{}", help="JSON of extra LLM(...) kwargs")
    args = parser.parse_args()
    runs = [run_once(args.model, json.loads(args.llm_kwargs)) for _ in range(args.runs)]
    for key in ("wall", "llm_wall", "import_cpu", "front_cpu", "engine_cpu"):
        values = [r[key] for r in runs]
        print(
            f"{key:11s} median {statistics.median(values):6.2f} s   runs: "
            + ", ".join(f"{v:.2f}" for v in values)
        )


if __name__ == "__main__":
    main()
