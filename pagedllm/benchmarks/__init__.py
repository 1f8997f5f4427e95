"""Benchmarks with vLLM's flags and output format (`pagedllm bench ...`).

- `datasets`: the random and ShareGPT workloads (`SampleRequest`).
- `metrics`: TTFT / TPOT / ITL / E2EL / goodput arithmetic over per-request timings.
- `latency`, `throughput`: offline benchmarks through `LLM` (throughput also through
  transformers, `--backend hf`).
- `serve`: an asyncio HTTP client that drives a running OpenAI-compatible server.
- `offline`, `memory`: building the engine from flags, JSON output, peak RSS.
"""
