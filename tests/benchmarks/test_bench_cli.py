"""Smoke tests of `pagedllm bench latency | throughput` on a tiny model: they finish, print
vLLM's lines and write valid JSON; both throughput backends see the same workload."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm.entrypoints.cli.main import main as cli_main

# A tiny KV cache keeps engine start-up fast.
ENGINE_FLAGS = ["--kv-cache-memory", str(4 << 20)]
WORKLOAD = ["--num-prompts", "6", "--input-len", "8", "--output-len", "4"]
WORKLOAD += ["--random-range-ratio", "0.5", "--prefix-len", "2"]
THROUGHPUT_LINE = re.compile(
    r"^Throughput: (\d+\.\d\d) requests/s, (\d+\.\d\d) total tokens/s, "
    r"(\d+\.\d\d) output tokens/s$",
    re.M,
)


def test_bench_without_a_benchmark_prints_help(capsys):
    assert cli_main(["bench"]) == 2
    assert "latency" in capsys.readouterr().out


def test_bench_latency(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "latency.json"
    rc = cli_main(
        ["bench", "latency", "--model", tiny_model_dir, "--input-len", "8", "--output-len", "4",
         "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
         "--output-json", str(path), *ENGINE_FLAGS]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    avg = float(re.search(r"^Avg latency: (\S+) seconds$", out, re.M).group(1))
    for p in (10, 25, 50, 75, 90, 99):
        assert re.search(rf"^{p}% percentile latency: \S+ seconds$", out, re.M)
    result = json.loads(path.read_text())
    assert len(result["latencies"]) == 3
    assert result["avg_latency"] == pytest.approx(avg)
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    pcts = [result["percentiles"][str(p)] for p in (10, 25, 50, 75, 90, 99)]
    assert pcts == sorted(pcts) and min(result["latencies"]) <= pcts[0]
    assert result["peak_rss_mib"] > 0


def test_bench_latency_rejects_bad_flags(tiny_model_dir, capsys):
    rc = cli_main(["bench", "latency", "--model", tiny_model_dir, "--num-iters", "0"])
    assert rc == 2
    assert "--num-iters=0" in capsys.readouterr().err


def _throughput(backend: str, model_dir: str, path, capsys) -> dict:
    rc = cli_main(
        ["bench", "throughput", "--backend", backend, "--model", model_dir,
         "--hf-max-batch-size", "4", "--output-json", str(path), *WORKLOAD, *ENGINE_FLAGS]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    match = THROUGHPUT_LINE.search(out)
    assert match, out
    result = json.loads(path.read_text())
    assert result["backend"] == backend
    assert result["num_requests"] == 6
    assert float(match.group(1)) == pytest.approx(result["requests_per_second"], abs=0.01)
    assert float(match.group(3)) == pytest.approx(result["output_tokens_per_second"], abs=0.01)
    elapsed = result["elapsed_time"]
    assert (
        result["total_num_tokens"] == result["total_prompt_tokens"] + result["total_output_tokens"]
    )
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / elapsed)
    assert f"Total num output tokens:  {result['total_output_tokens']}" in out
    return result


def test_bench_throughput_both_backends_same_workload(tiny_model_dir, tmp_path, capsys):
    ours = _throughput("pagedllm", tiny_model_dir, tmp_path / "ours.json", capsys)
    hf = _throughput("hf", tiny_model_dir, tmp_path / "hf.json", capsys)
    # Same seeded prompts; the engine ignores EOS and hf counts each request's own length,
    # so both report exactly the workload's tokens.
    assert ours["total_prompt_tokens"] == hf["total_prompt_tokens"]
    assert ours["total_output_tokens"] == hf["total_output_tokens"]
    assert 6 * (2 + 4) <= ours["total_prompt_tokens"] <= 6 * (2 + 12)
    assert 6 * 2 <= ours["total_output_tokens"] <= 6 * 6
    # --dtype auto on the CPU, like the engine: bf16 where the CPU has it fast, else fp32.
    from pagedllm.config import cpu_has_fast_bf16

    assert hf["hf_dtype"] == ("bfloat16" if cpu_has_fast_bf16() else "float32")
    assert hf["hf_num_batches"] == 2
