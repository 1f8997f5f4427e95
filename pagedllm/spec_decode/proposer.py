"""The proposer interface, the per-step `DraftBatch` it reads, and what model-based proposers
share: building their attention metadata, owning a paged KV cache, loading a head checkpoint.

Contract with the model runner, once per step after verification: `propose(batch)` returns, for
each request that sampled this step (`batch.sample_idx`, in that order), up to k draft tokens
to verify next step. The runner has already appended the step's accepted tokens to each
request's `token_ids`, so for request i the positions `start[i] .. start[i] + num_valid[i] - 1`
hold tokens whose target KV is now valid (the scheduler rolled back the rest), and when it
sampled, its last token `token_ids[-1]` sits at position `start[i] + num_valid[i]`.

Model-based proposers (draft model, EAGLE) keep their own KV tensors over the *same* block ids
as the target: the scheduler's allocation (with `num_lookahead_tokens = k` extra slots) covers
both, and every step the proposer rewrites its KV for exactly the positions the target
computed, so it never reads a slot the target's bookkeeping does not own. Their byte cost per
block is added to the target's when the worker sizes the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.layer import bind_kv_caches, get_attention_layers

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.spec_decode.config import SpeculativeConfig


@dataclass
class DraftBatch:
    """One step's batch as proposers see it (B scheduled requests, T flattened rows)."""

    states: list[Any]  # [B] the runner's CachedRequestState (token_ids, block_ids, params)
    start: np.ndarray  # [B] int64 first position run this step (num_computed_tokens before)
    num_valid: np.ndarray  # [B] int64 leading rows whose KV stays valid after verification
    row_start: np.ndarray  # [B] int64 first row of each request in the flattened batch
    sample_idx: np.ndarray  # [S] int64 requests that sampled this step, batch order
    hidden: torch.Tensor  # [T, hidden] the target's last hidden states of this step


class Proposer:
    """Drafts k tokens per sampling request (see the module docstring)."""

    def load_model(self, target_model: nn.Module) -> None:
        """Load the proposer's weights (may share modules with the target)."""

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, backend: AttentionBackend) -> None:
        """Allocate the proposer's own KV tensors over `num_blocks` shared block ids."""

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        raise NotImplementedError


def make_proposer(config: EngineConfig, spec: SpeculativeConfig, device: torch.device) -> Proposer:
    """The proposer for `spec.method`."""
    if spec.method == "ngram":
        from pagedllm.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, spec, device)
    if spec.method == "eagle":
        from pagedllm.spec_decode.eagle import EagleProposer

        return EagleProposer(config, spec, device)
    if spec.method == "medusa":
        from pagedllm.spec_decode.medusa import MedusaProposer

        return MedusaProposer(config, spec, device)
    raise ValueError(f"speculative_config.method={spec.method!r} is not supported")


# ---- model-based proposers ----------------------------------------------------------------


class PagedModelProposer(Proposer):
    """A proposer running a model with its own paged KV cache over the target's block ids."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, device: torch.device):
        self.config = config
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.device = device
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.dtype = config.model_config.dtype
        self.model: nn.Module | None = None
        self.backend: AttentionBackend | None = None
        self.kv_caches: list[torch.Tensor] = []

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_size * elem
            for layer in get_attention_layers(self.model)
        )

    def initialize_kv_cache(self, num_blocks: int, backend: AttentionBackend) -> None:
        layers = get_attention_layers(self.model)
        self.kv_caches = [
            torch.zeros(
                backend.get_kv_cache_shape(
                    num_blocks, self.block_size, layer.num_kv_heads, layer.head_size
                ),
                dtype=self.dtype,
                device=self.device,
            )
            for layer in layers
        ]
        bind_kv_caches(self.model, self.kv_caches, backend)
        self.backend = backend

    def block_table(self, states: list[Any]) -> np.ndarray:
        """[B, max_blocks] int32 block ids of each request (zero padded)."""
        max_blocks = max(len(s.block_ids) for s in states)
        table = np.zeros((len(states), max_blocks), dtype=np.int32)
        for i, s in enumerate(states):
            table[i, : len(s.block_ids)] = s.block_ids
        return table

    def attention_metadata(
        self, block_table: np.ndarray, first_pos: np.ndarray, num_rows: np.ndarray
    ) -> tuple[Any, torch.Tensor]:
        """Metadata for running `num_rows[r]` tokens of request r at positions `first_pos[r]`,
        `first_pos[r] + 1`, ... over `block_table [R, max_blocks]` -> (metadata, positions).

        Positions past max_model_len - 1 (drafts the scheduler would drop anyway) are clamped to
        it: they stay inside the slots the scheduler reserved and inside the RoPE table."""
        num_reqs = len(num_rows)
        total = int(num_rows.sum())
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_rows, out=cu[1:])
        req_idx = np.repeat(np.arange(num_reqs), num_rows)  # [N]
        positions = first_pos[req_idx] + (np.arange(total) - cu[:-1][req_idx])  # [N]
        np.minimum(positions, self.max_model_len - 1, out=positions)
        bs = self.block_size
        slots = block_table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (positions[cu[1:] - 1] + 1).astype(np.int32)  # last position + 1
        dev = self.device
        common = CommonAttentionMetadata.from_numpy(cu, seq_lens, block_table, slots, bs, dev)
        return self.backend.build_metadata(common), torch.from_numpy(positions).to(dev)


def gather_token_ids(states: list[Any], first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate `states[i].token_ids[first[i] : first[i] + counts[i]]` -> [sum] int64."""
    parts = [s.token_ids[a : a + n] for s, a, n in zip(states, first.tolist(), counts.tolist())]
    return np.fromiter(
        itertools.chain.from_iterable(parts), dtype=np.int64, count=int(counts.sum())
    )


def draft_limits(states: list[Any], k: int) -> list[int]:
    """Drafts worth proposing per request: k, fewer when max_tokens leaves less room (a step
    emits at most drafts + 1 tokens)."""
    limits = []
    for s in states:
        max_tokens = s.sampling_params.max_tokens
        room = k if max_tokens is None else max_tokens - len(s.output_token_ids) - 1
        limits.append(max(0, min(k, room)))
    return limits


def run_proposer(proposer: Proposer, batch: DraftBatch) -> list[list[int]]:
    """Run `proposer` on the step's batch -> drafts per request in batch order ([] for those
    that did not sample), each cut to its `draft_limits`."""
    out: list[list[int]] = [[] for _ in batch.states]
    idx = batch.sample_idx.tolist()
    drafts = proposer.propose(batch)
    limits = draft_limits([batch.states[i] for i in idx], 1 << 30)
    for i, d, n in zip(idx, drafts, limits):
        out[i] = list(d[:n])
    return out


# ---- loading a head checkpoint --------------------------------------------------------------


def checkpoint_tensor_names(model_dir: str) -> set[str]:
    """Names of the tensors in a checkpoint directory, without reading the tensors."""
    from pagedllm.models.loader import iterate_weights, list_weight_files

    names: set[str] = set()
    for path in list_weight_files(model_dir):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.update(f.keys())
        else:
            names.update(name for name, _ in iterate_weights(path.parent))
            break
    return names


def load_head(
    build: Callable[[], nn.Module], model_dir: str, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Build a head module in `dtype` on `device` (parameters allocated in place), stream the
    checkpoint into its `load_weights`, check nothing is missing, run the layers'
    `process_weights_after_loading` hooks. The head's `load_weights(weights)` returns the
    names of the parameters it filled."""
    from pagedllm.models.loader import default_dtype, iterate_weights

    with default_dtype(dtype), device:
        module = build()
    with torch.no_grad():
        loaded = module.load_weights(iterate_weights(model_dir))
    missing = sorted(name for name, _ in module.named_parameters() if name not in loaded)
    if missing:
        raise ValueError(
            f"speculative_config.model={model_dir!r} has no weights for {type(module).__name__} "
            f"parameters {missing[:10]}"
        )
    for sub in module.modules():
        hook = getattr(sub, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    return module.eval()
