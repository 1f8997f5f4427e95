"""The engine's memory over waves of requests, in-process (no server): each wave adds
`--requests` random requests (prompts of 5-40 tokens, 4-24 output tokens, greedy or sampled,
a tenth aborted early), steps until they are done, and prints the process's anonymous RSS,
the live CPU tensors and their bytes. A leak grows every wave; a bounded cache levels off.

    python scripts/engine_memory_waves.py --model DIR --waves 16
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from pagedllm.engine import EngineCoreRequest
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def anon_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--waves", type=int, default=16)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    config = EngineArgs(model=args.model, max_model_len=args.max_model_len).create_engine_config()
    core = EngineCore(config)
    vocab = config.model_config.vocab_size
    rng = random.Random(0)
    count = 0
    for wave in range(args.waves):
        ids = []
        for _ in range(args.requests):
            count += 1
            params = SamplingParams(
                max_tokens=rng.randint(4, 24),
                ignore_eos=True,
                temperature=rng.choice([0.0, 0.8]),
                output_kind=RequestOutputKind.DELTA,
            )
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(5, 40))]
            request = EngineCoreRequest(
                request_id=f"r{count}",
                prompt_token_ids=prompt,
                sampling_params=params,
                arrival_time=time.time(),
                priority=0,
                eos_token_id=None,
            )
            core.add_request(request)
            ids.append(request.request_id)
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
            if steps == 3:
                core.abort_requests(rng.sample(ids, len(ids) // 10))
        gc.collect()
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        live = sum(t.numel() * t.element_size() for t in tensors if t.layout == torch.strided)
        print(
            f"wave {wave}: anon {anon_mib()} MiB, {len(tensors)} live tensors "
            f"({live >> 20} MiB), {steps} steps",
            flush=True,
        )
    core.shutdown()


if __name__ == "__main__":
    main()
