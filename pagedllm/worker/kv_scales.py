"""`calculate_kv_scales`: each attention layer's fp8 K and V scales from one calibration
forward at start-up, vLLM's "random token calibration".

The forward runs the model over `num_tokens` seeded random token ids as one prompt, on a scratch
KV cache (as the GPU memory profile does, worker/gpu_memory.py), with a hook on every attention
layer reading the largest |K| and |V| it is given (after RoPE and any q/k norm, what the cache
would store). A layer's scales are then max |K| / K_SCALE_CONSTANT and max |V| /
V_SCALE_CONSTANT (vLLM's defaults, 200 and 100: the stored values reach at most 200 and 100,
below e4m3's 448), floored at `MIN_KV_SCALE` (attention/fp8_kv.py); a layer whose K or V were
all zero keeps 1.0. The token ids come from a generator seeded by the model's seed, so every
engine on the same checkpoint, seed and settings (data-parallel ranks, a prefill and a decode
instance) computes the same scales. With tensor parallelism the ranks take the largest of
their heads' maxima (a max over the group), so a layer's scales are the whole layer's, as
with one rank; with pipeline parallelism each stage scales its own layers (every rank runs
the forward together).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention.fp8_kv import MIN_KV_SCALE, KVScales
from pagedllm.attention.layer import get_attention_layers
from pagedllm.distributed.parallel_state import get_tp_group

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
# Tokens of the calibration prompt, at most max_model_len. One forward whatever the step's
# token budget: the scales then depend on the checkpoint, seed and max_model_len only, so
# engines with other budgets (a prefill and a decode instance) agree on them.
CALIBRATION_TOKENS = 1024


def calibration_tokens(config: EngineConfig) -> int:
    """Tokens of the calibration prompt."""
    return min(CALIBRATION_TOKENS, config.model_config.max_model_len)


def scales_from_maxima(k_max: float, v_max: float) -> KVScales:
    """A layer's scales from the largest |K| and |V| it saw."""

    def one(m: float, constant: float) -> float:
        return max(m / constant, MIN_KV_SCALE) if m > 0 else 1.0

    return KVScales(one(k_max, K_SCALE_CONSTANT), one(v_max, V_SCALE_CONSTANT))


@torch.inference_mode()
def calculate_kv_scales(runner: ModelRunner) -> list[KVScales]:
    """Set the scales of every attention layer of `runner.model` (this rank's) from one
    calibration forward; returns them in layer order."""
    layers = get_attention_layers(runner.model)
    maxima = {id(layer): [0.0, 0.0] for layer in layers}

    def record(module, args) -> None:
        _, k, v, _ = args
        seen = maxima[id(module)]
        if k.numel():
            seen[0] = max(seen[0], float(k.detach().abs().max()))
            seen[1] = max(seen[1], float(v.detach().abs().max()))

    num_tokens = calibration_tokens(runner.config)
    device = runner.device
    vocab = runner.config.model_config.hf_config.vocab_size
    gen = torch.Generator().manual_seed(runner.config.model_config.seed)
    input_ids = torch.randint(vocab, (num_tokens,), generator=gen).to(device)
    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        with runner.scratch_prompts(np.array([num_tokens], dtype=np.int64)) as (common, positions):
            runner.forward(common, input_ids, positions)
    finally:
        for hook in hooks:
            hook.remove()
    if device.type == "cuda":  # the forward's activations, before the real cache is allocated
        torch.cuda.empty_cache()
    seen = torch.tensor([maxima[id(layer)] for layer in layers], dtype=torch.float32)  # [L, 2]
    tp = get_tp_group()
    if tp.world_size > 1 and layers:  # every rank's heads: the layer's maxima
        seen = tp.all_gather(seen[None].to(device), dim=0).amax(0).cpu()
    scales = [scales_from_maxima(float(k), float(v)) for k, v in seen.tolist()]
    for layer, s in zip(layers, scales):
        layer.set_kv_scales(s)
    if scales:
        ks, vs = [s.k for s in scales], [s.v for s in scales]
        logger.info(
            "calculate_kv_scales: %d layers from a %d-token calibration forward: k_scale "
            "%.4g-%.4g, v_scale %.4g-%.4g",
            len(scales),
            num_tokens,
            min(ks),
            max(ks),
            min(vs),
            max(vs),
        )
    return scales
