"""`pagedllm bench throughput`: offline throughput of a whole workload, pagedllm or transformers.

`--backend pagedllm` hands every request to one `LLM.generate` call (EOS ignored, so each
request produces exactly its output length) and times that call. `--backend hf` runs the
same token-id prompts through transformers' `generate` the way vLLM's hf baseline does:
requests are taken in dataset order into left-padded batches of at most
`--hf-max-batch-size`, a batch closing early when its longest prompt plus its longest output
would pass 2048 tokens (or the model's context); each batch runs to its longest output
(`min_new_tokens = max_new_tokens`, so EOS cannot cut it short) and only each request's own
output length counts as generated. Both sample with temperature 1.0 and top-p 1.0, in the
dtype `--dtype` resolves to (bf16 on the CPU for `auto`, like the engine). Model loading is
not timed.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagedllm.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests
from pagedllm.benchmarks.offline import add_model_and_engine_args, engine_kwargs, write_json

BACKENDS = ("pagedllm", "hf")
# vLLM's hf baseline packs a batch only while prompt + output fits this many tokens.
HF_MAX_BATCH_TOKENS = 2048


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="pagedllm")
    parser.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    parser.add_argument(
        "--hf-max-batch-size", type=int, default=16, help="batch size of the hf backend"
    )
    parser.add_argument("--disable-detokenize", action="store_true")
    parser.add_argument("--output-json", default=None, help="write the results here")
    add_dataset_args(parser)
    add_model_and_engine_args(parser)


def plan_hf_batches(
    requests: list[SampleRequest], max_batch_size: int, max_tokens: int = HF_MAX_BATCH_TOKENS
) -> list[list[SampleRequest]]:
    """Split requests, in order, into batches of at most `max_batch_size` whose longest
    prompt plus longest output stays within `max_tokens` (a request alone may exceed it)."""
    if max_batch_size <= 0:
        raise ValueError(f"--hf-max-batch-size={max_batch_size} must be positive")
    batches: list[list[SampleRequest]] = []
    batch: list[SampleRequest] = []
    max_prompt = max_output = 0
    for req in requests:
        fits = (
            max(max_prompt, req.prompt_len) + max(max_output, req.expected_output_len) <= max_tokens
        )
        if batch and (len(batch) == max_batch_size or not fits):
            batches.append(batch)
            batch, max_prompt, max_output = [], 0, 0
        batch.append(req)
        max_prompt = max(max_prompt, req.prompt_len)
        max_output = max(max_output, req.expected_output_len)
    if batch:
        batches.append(batch)
    return batches


def _load_tokenizer_and_vocab(args: argparse.Namespace) -> tuple[Any, int]:
    from pagedllm.transformers_utils.config import get_hf_config
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    hf_config = get_hf_config(args.model, args.trust_remote_code)
    vocab = min(len(tokenizer), getattr(hf_config, "vocab_size", None) or len(tokenizer))
    return tokenizer, vocab


def run_pagedllm(requests: list[SampleRequest], args: argparse.Namespace) -> dict[str, Any]:
    """Time one `LLM.generate` over all requests; returns elapsed time and token counts."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.memory import peak_rss_mib

    llm = LLM(**engine_kwargs(args))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(
            n=args.n,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=r.expected_output_len,
            detokenize=not args.disable_detokenize,
        )
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"elapsed_time": elapsed, "output_tokens": generated, "peak_rss_mib": peak_rss_mib()}


def _hf_device_and_dtype(args: argparse.Namespace, hf_config: Any) -> tuple[str, Any]:
    import torch

    from pagedllm.config import resolve_dtype

    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
    ckpt_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return device, resolve_dtype(args.dtype, ckpt_dtype, device, pagedllm_kernels=False)


def run_hf(
    requests: list[SampleRequest], args: argparse.Namespace, tokenizer: Any
) -> dict[str, Any]:
    """transformers' batched `generate` over the same requests (see the module docstring)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from pagedllm.benchmarks.memory import peak_rss_mib
    from pagedllm.transformers_utils.config import get_hf_config

    hf_config = get_hf_config(args.model, args.trust_remote_code)
    device, dtype = _hf_device_and_dtype(args, hf_config)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, trust_remote_code=args.trust_remote_code
    ).to(device)
    model.eval()
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    context = getattr(hf_config, "max_position_embeddings", None) or HF_MAX_BATCH_TOKENS
    batches = plan_hf_batches(requests, args.hf_max_batch_size, min(HF_MAX_BATCH_TOKENS, context))
    torch.manual_seed(args.seed)
    bar = tqdm(total=len(requests), desc="Processed prompts (hf)", dynamic_ncols=True)
    start = time.perf_counter()
    for batch in batches:
        width = max(r.prompt_len for r in batch)
        max_out = max(r.expected_output_len for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends at column `width`
            input_ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            attention_mask[i, width - r.prompt_len :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                num_return_sequences=args.n,
                min_new_tokens=max_out,
                max_new_tokens=max_out,
                pad_token_id=pad_id,
                use_cache=True,
            )
        if not args.disable_detokenize:
            tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    useful = sum(r.expected_output_len for r in requests) * args.n
    return {
        "elapsed_time": elapsed,
        "output_tokens": useful,
        "peak_rss_mib": peak_rss_mib(),
        "hf_dtype": str(dtype).removeprefix("torch."),
        "hf_num_batches": len(batches),
    }


def main(args: argparse.Namespace) -> int:
    if args.n <= 0:
        raise ValueError(f"--n={args.n} must be positive")
    tokenizer, vocab = _load_tokenizer_and_vocab(args)
    requests = get_requests(args, tokenizer, vocab)
    if args.backend == "hf":
        result = run_hf(requests, args, tokenizer)
    else:
        result = run_pagedllm(requests, args)
    elapsed = result["elapsed_time"]
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = result["output_tokens"]
    total_tokens = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(requests) / elapsed:.2f} requests/s, "
        f"{total_tokens / elapsed:.2f} total tokens/s, "
        f"{output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    print(f"Peak memory (RSS, with engine processes): {result['peak_rss_mib']:.1f} MiB")
    if args.output_json:
        write_json(
            args.output_json,
            {
                "backend": args.backend,
                "elapsed_time": elapsed,
                "num_requests": len(requests),
                "total_num_tokens": total_tokens,
                "total_prompt_tokens": prompt_tokens,
                "total_output_tokens": output_tokens,
                "requests_per_second": len(requests) / elapsed,
                "tokens_per_second": total_tokens / elapsed,
                "output_tokens_per_second": output_tokens / elapsed,
                **{k: v for k, v in result.items() if k not in ("elapsed_time", "output_tokens")},
            },
        )
    return 0
