"""The beam-search benchmark runs end to end on the tiny model and reports what it claims:
the engine's beam search finds the same best beam as vLLM's re-submission loop (fp32), and
its beams share blocks, so its peak KV usage is below K independent samples'."""

from __future__ import annotations

import json

from pagedllm.benchmarks import beam_search


def test_beam_search_benchmark(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    path = tmp_path / "beam.json"
    result = beam_search.main(
        ["--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-memory", str(4 << 20),
         "--num-prompts", "2", "--prompt-len", "40", "--max-tokens", "24", "--repeats", "1",
         "--block-size", "8",
         "--output-json", str(path)]
    )  # fmt: skip
    assert json.loads(path.read_text()) == result
    assert result["same_best_beam_as_vllm_style"] is True
    assert result["beam_search_peak_kv_blocks"] < result["n_samples_peak_kv_blocks"]
    assert result["beam_search_peak_shared_blocks"] > 0 and result["beam_search_block_copies"] > 0
    for mode in beam_search.MODES:
        assert result[f"{mode}_seconds"] > 0
