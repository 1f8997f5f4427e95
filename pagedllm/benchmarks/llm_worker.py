"""One engine's side of `vs_vllm`: runs pagedllm's or vLLM's `LLM` and times what it is told.

Usage (any interpreter that has the engine): python llm_worker.py ENGINE MODEL [LLM kwargs JSON]

The file imports only the standard library, torch and the engine it drives (`pagedllm` or
`vllm`: both have the same `LLM` / `SamplingParams` API), so vLLM's own virtual environment
can run it as a plain script. The engine is built once (start-up is not timed); then each
line on stdin is one JSON command, and each answer is one line on stdout starting with
`RESULT_MARK` (the engines log to stdout too; the driver skips everything else):

- `{"op": "generate", "prompts": [[ids]], "max_tokens": [n], "sampling": {...}}`: one
  `LLM.generate` of the token-id prompts (EOS ignored; `sampling`: SamplingParams fields,
  temperature 1 and top-p 1 when it is absent) -> seconds, output tokens (of every choice).
- `{"op": "profile", ...generate fields}`: the same under `torch.profiler` -> per-op self CPU
  time (needs the engine in this process: the driver turns its multiprocessing off).
- `{"op": "quit"}`.
"""

from __future__ import annotations

import json
import sys
import time

RESULT_MARK = "@@vs_vllm "
DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0}  # unless a command sets `sampling`


def _reply(obj: dict) -> None:
    sys.stdout.write(RESULT_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _profile(llm, prompts, params, top: int) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    rows = [
        {"name": e.key, "calls": e.count, "self_us": e.self_cpu_time_total}
        for e in prof.key_averages()
    ]
    rows.sort(key=lambda r: -r["self_us"])
    total = sum(r["self_us"] for r in rows)
    del torch
    return [{"name": "(all ops)", "calls": 0, "self_us": total}] + rows[:top]


def main(argv: list[str]) -> int:
    engine, model = argv[1], argv[2]
    kwargs = json.loads(argv[3]) if len(argv) > 3 else {}
    if engine == "vllm":
        from vllm import LLM, SamplingParams
    elif engine == "pagedllm":
        from pagedllm import LLM, SamplingParams
    else:
        raise SystemExit(f"unknown engine {engine!r}: 'vllm' or 'pagedllm'")
    start = time.perf_counter()
    llm = LLM(model=model, **kwargs)
    startup_s = time.perf_counter() - start
    import torch

    dtype = llm.llm_engine.model_config.dtype  # both engines have it there
    weight_bytes = torch.empty((), dtype=dtype).element_size()
    _reply({"op": "ready", "startup_s": startup_s, "weight_bytes": weight_bytes})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        sampling = cmd.get("sampling") or DEFAULT_SAMPLING
        params = [
            SamplingParams(**sampling, ignore_eos=True, max_tokens=n) for n in cmd["max_tokens"]
        ]
        if cmd["op"] == "profile":
            _reply({"op": "profile", "rows": _profile(llm, prompts, params, cmd.get("top", 40))})
            continue
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        _reply({"op": "generate", "seconds": elapsed, "output_tokens": tokens})
    del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
