"""The pagedllm-vs-vLLM driver: workloads, roofline arithmetic, and a whole run against
pagedllm alone (vLLM's CPU build is not installed in CI), int8 included."""

from __future__ import annotations

import json
import os

from pagedllm.benchmarks import vs_vllm


def test_workloads_are_the_issues_and_seeded():
    ((prompts, outs),) = vs_vllm.workload("mixed", 700, seed=0)
    assert len(prompts) == 128 and all(32 <= len(p) <= 256 for p in prompts)
    assert all(16 <= n <= 128 for n in outs) and all(3 <= t < 700 for t in prompts[0])
    assert vs_vllm.workload("mixed", 700, seed=0) == vs_vllm.workload("mixed", 700, seed=0)
    assert vs_vllm.workload("mixed", 700, seed=1) != vs_vllm.workload("mixed", 700, seed=0)
    ((prompts, outs),) = vs_vllm.workload("batch64", 700, seed=0)
    assert [len(p) for p in prompts] == [128] * 64 and outs == [128] * 64
    long, short = vs_vllm.workload("decode1", 700, seed=0)
    assert long[1] == [1 + vs_vllm.DECODE_TOKENS] and short[1] == [1]
    # prefill: prompts of mixed's lengths, one output token each, none of them any round's
    # mixed prompt (which the prefix cache would serve)
    ((prompts, outs),) = vs_vllm.workload("prefill", 700, seed=3)
    assert len(prompts) == 128 and all(32 <= len(p) <= 256 for p in prompts) and outs == [1] * 128
    mixed = {tuple(p) for r in range(4) for p in vs_vllm.workload("mixed", 700, seed=r)[0][0]}
    assert not mixed & {tuple(p) for p in prompts}
    ((prompts, outs),) = vs_vllm.workload("long", 700, seed=0)
    assert len(prompts) == 16 and all(1024 <= len(p) <= 3072 for p in prompts)
    assert all(32 <= n <= 128 for n in outs)


def test_model_shape_counts_flops_and_bytes(tmp_path):
    cfg = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=10)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = vs_vllm.ModelShape.from_dir(str(tmp_path))
    per_layer = 8 * (2 + 2) * 4 + 2 * 4 * 8 + 3 * 8 * 16  # qkv, o, gate/up/down
    assert shape.linear_params == 2 * per_layer and shape.head_params == 80
    assert shape.decode_bytes(2.0) == 2 * (2 * per_layer + 80)
    # one prompt token, one output: only the prompt token is fed (1 token, 1 key)
    assert shape.flops([1], [1]) == 2 * 2 * per_layer + 2 * 80 + 4 * 8 * 2 * 1
    # 3 prompt tokens, 2 outputs: 4 tokens fed, attention over 1 + 2 + 3 + 4 keys
    assert shape.flops([3], [2]) == 2 * 2 * per_layer * 4 + 2 * 80 * 2 + 4 * 8 * 2 * 10
    # two choices share the prompt: 3 + 2 x 1 tokens fed, 3 x 2 sampled; attention over the
    # prompt's 1 + 2 + 3 keys once and each choice's 4
    assert shape.flops([3], [2], choices=2) == (
        2 * 2 * per_layer * 5 + 2 * 80 * 4 + 4 * 8 * 2 * (6 + 2 * 4)
    )


def test_driver_runs_pagedllm_and_int8(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # the workers inherit it
    out = tmp_path / "result.json"
    argv = ["--model", tiny_model_dir, "--engines", "pagedllm", "--int8", "--rounds", "1",
            "--workloads", "decode1", "prefill", "--kv-cache-gib", "0.05", "--output-json", str(out),
            "--sampling", '{"temperature": 0.7, "top_k": 20, "top_p": 0.8}']  # fmt: skip
    assert vs_vllm.main(argv) == 0
    result = json.loads(out.read_text())
    for name in ("pagedllm", "pagedllm-int8"):
        assert result[name]["decode1"]["tokens_per_s"] > 0 and result[name]["decode1"]["gb_s"] > 0
        assert (
            result[name]["prefill"]["tokens_per_s"] > 0 and result[name]["prefill"]["gflop_s"] > 0
        )
    assert "| decode1 |" in capsys.readouterr().out


def test_sampling_fields_reach_every_request(tiny_model_dir, monkeypatch):
    """--sampling's fields become the requests' SamplingParams: one the engine refuses stops
    the run with the worker's error instead of being ignored."""
    import pytest

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    argv = ["--model", tiny_model_dir, "--engines", "pagedllm", "--rounds", "1",
            "--workloads", "decode1", "--kv-cache-gib", "0.05", "--sampling", '{"top_p": 0.0}']  # fmt: skip
    with pytest.raises(RuntimeError, match="worker exited"):
        vs_vllm.main(argv)


def test_no_amx_runs_both_engines_without_tiles(monkeypatch):
    """--no-amx: pagedllm with PAGEDLLM_CPU_AMX=0, oneDNN held to AVX-512 BF16 in both, and
    vLLM's processes importing the sitecustomize that makes torch report no AMX tiles."""
    import subprocess
    import sys

    monkeypatch.delenv("PYTHONPATH", raising=False)
    args = vs_vllm.parse_args(["--model", "m", "--no-amx", "--pagedllm-env", "X=1"])
    vllm_env, paged_env = vs_vllm.worker_envs(args, in_process=False)
    assert paged_env["PAGEDLLM_CPU_AMX"] == "0" and paged_env["X"] == "1"
    assert "PYTHONPATH" not in paged_env and "PAGEDLLM_CPU_AMX" not in vllm_env
    for env in (vllm_env, paged_env):
        assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    check = "import torch; print(torch.cpu._is_amx_tile_supported())"
    out = subprocess.run(
        [sys.executable, "-c", check], env=vllm_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
    plain = vs_vllm.worker_envs(vs_vllm.parse_args(["--model", "m"]), in_process=False)
    assert all("ONEDNN_MAX_CPU_ISA" not in e and "PAGEDLLM_CPU_AMX" not in e for e in plain)


def test_worker_counts_every_choice(tiny_model_dir, monkeypatch):
    """A generate with n > 1 reports the tokens of all n choices, not the first one's."""
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    kwargs = {"kv_cache_memory": 1 << 24}
    argv = vs_vllm.worker_argv("pagedllm", tiny_model_dir, kwargs, "")
    worker = vs_vllm.Worker.start("pagedllm", argv, dict(os.environ))
    try:
        cmd = {"op": "generate", "prompts": [[5, 6, 7], [8, 9]], "max_tokens": [4, 6]}
        assert worker.ask({**cmd, "sampling": {"n": 3, "temperature": 1.0}})["output_tokens"] == 30
        assert worker.ask(cmd)["output_tokens"] == 10
    finally:
        worker.stop()


def test_other_workloads_shapes_and_parallel_choices():
    ((prompts, outs),) = vs_vllm.workload("wide", 700, seed=0)
    assert len(prompts) == 256 and all(64 <= len(p) <= 512 for p in prompts)
    assert all(32 <= n <= 256 for n in outs)
    ((prompts, outs),) = vs_vllm.workload("short", 700, seed=0)
    assert len(prompts) == 512 and all(8 <= len(p) <= 32 for p in prompts)
    assert all(8 <= n <= 32 for n in outs)
    ((prompts, outs),) = vs_vllm.workload("batch8", 700, seed=0)
    assert [len(p) for p in prompts] == [512] * 8 and outs == [256] * 8
    ((prompts, outs),) = vs_vllm.workload("parallel", 700, seed=0)
    assert [len(p) for p in prompts] == [128] * 32 and outs == [128] * 32

    class Recorder:
        def __init__(self):
            self.cmds = []

        def ask(self, cmd):
            self.cmds.append(cmd)
            return {"seconds": 2.0, "output_tokens": 32 * 128 * vs_vllm.PARALLEL_N}

    rec = Recorder()
    res = vs_vllm.run_workload(rec, "parallel", 700, seed=0, sampling={"temperature": 0.8})
    assert rec.cmds[0]["sampling"] == {"temperature": 0.8, "top_p": 1.0, "n": vs_vllm.PARALLEL_N}
    assert res["tokens_per_s"] == 32 * 128 * vs_vllm.PARALLEL_N / 2.0
    import pytest

    with pytest.raises(ValueError, match="n=4"):
        vs_vllm.run_workload(rec, "parallel", 700, seed=0, sampling={"n": 2})
