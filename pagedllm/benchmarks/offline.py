"""What the offline benchmarks (`latency`, `throughput`) share: the model flag, building an
`LLM` from every engine flag, and writing a JSON result."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any


def add_model_and_engine_args(parser: argparse.ArgumentParser) -> None:
    """`--model DIR` plus every `EngineArgs` flag (`--dtype`, `--max-num-seqs`, ...)."""
    from pagedllm.engine.arg_utils import EngineArgs

    parser.add_argument("--model", required=True, help="checkpoint directory")
    EngineArgs.add_cli_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(**engine_kwargs(args))`: the engine flags as keyword arguments."""
    from pagedllm.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(args).as_kwargs()


def make_llm(args: argparse.Namespace) -> Any:
    from pagedllm import LLM

    return LLM(**engine_kwargs(args))


def _json_safe(value: Any) -> Any:
    # Strict JSON has no Infinity/NaN; vLLM writes an infinite request rate as "inf".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write `result` as strict JSON (creating the directory)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(result), f, indent=4, allow_nan=False)
        f.write("\n")


def report(result: dict[str, Any], output_json: str | None) -> None:
    """Print `result` one key a line (floats to 4 significant digits); write it as JSON to
    `output_json` when given."""
    for key, value in result.items():
        print(f"{key:40s} {value:.4g}" if isinstance(value, float) else f"{key:40s} {value}")
    if output_json:
        write_json(output_json, result)
