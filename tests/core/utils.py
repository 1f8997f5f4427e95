"""Factories for the core tests: a scheduler over a fake model config, requests, and a fake
model runner that samples fixed tokens. Pure CPU, no model."""

from __future__ import annotations

import types

import torch

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.core.request import Request
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine import EngineCoreOutputs
from pagedllm.outputs import LogprobsLists, ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams

EOS_TOKEN_ID = 2
# What the fake runner samples unless told otherwise (never EOS, never a stop token below).
DEFAULT_TOKEN = 7


def create_scheduler(
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    num_blocks: int = 1000,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    kv_transfer_config: KVTransferConfig | None = None,
    parallel_config: ParallelConfig | None = None,
) -> Scheduler:
    model_config = ModelConfig(
        model="fake",
        tokenizer="fake",
        hf_config=types.SimpleNamespace(
            vocab_size=1000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4
        ),
        dtype=torch.float32,
        max_model_len=max_model_len,
        eos_token_ids=[EOS_TOKEN_ID],
    )
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching, num_blocks=num_blocks
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    config = EngineConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=parallel_config or ParallelConfig(),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    return Scheduler(config)


def create_requests(
    num_requests: int,
    prompt_len: int = 16,
    max_tokens: int | None = 16,
    *,
    same_prompt: bool = False,
    priorities: list[int] | None = None,
    prefix: str = "req",
    first_arrival: float = 0.0,
    **params,
) -> list[Request]:
    """Requests with distinct prompts (no accidental prefix hits) unless `same_prompt`;
    arrival times 0, 1, 2, ...; extra kwargs go to SamplingParams."""
    requests = []
    for i in range(num_requests):
        base = 100 if same_prompt else 100 + 10_000 * (i + 1)
        sampling_params = SamplingParams(max_tokens=max_tokens, **params)
        sampling_params.update_from_generation_config({}, [EOS_TOKEN_ID])
        requests.append(
            Request(
                request_id=f"{prefix}{i}",
                prompt_token_ids=list(range(base, base + prompt_len)),
                sampling_params=sampling_params,
                eos_token_id=EOS_TOKEN_ID,
                arrival_time=first_arrival + i,
                priority=priorities[i] if priorities else 0,
            )
        )
    return requests


def make_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    tokens: dict[str, list[int]] | None = None,
    logprobs: bool = False,
) -> ModelRunnerOutput:
    """What a runner returns for `scheduler_output`: requests whose scheduled tokens reach
    the end of their known tokens sample `tokens[req_id]` (default [DEFAULT_TOKEN]); with
    `logprobs`, each sampled token gets logprob -1.0 and rank 1."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    lists: list[LogprobsLists | None] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens >= request.num_tokens:
            toks = list((tokens or {}).get(req_id, [DEFAULT_TOKEN]))
        else:
            toks = []
        sampled.append(toks)
        lists.append(
            LogprobsLists([[t] for t in toks], [[-1.0] for _ in toks], [1] * len(toks))
            if logprobs and toks
            else None
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=lists if logprobs else None,
    )


def step(
    scheduler: Scheduler, tokens: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One engine step with the fake runner; checks the scheduler's integrity afterwards."""
    scheduler_output = scheduler.schedule()
    runner_output = make_runner_output(scheduler, scheduler_output, tokens)
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    scheduler.check_integrity()
    return scheduler_output, outputs


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, list]:
    """Step until no request is left; returns req_id -> [tokens, finish_reason]."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        _, outputs = step(scheduler)
        for out in outputs.outputs:
            entry = results.setdefault(out.request_id, [[], None])
            entry[0].extend(out.new_token_ids)
            entry[1] = out.finish_reason
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
