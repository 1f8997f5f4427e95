"""The proposer interface, the per-step `DraftBatch` it reads and the `Proposal` it returns,
and what model-based proposers share: drawing draft tokens (`DraftSampler`), building their
attention metadata, owning a paged KV cache, loading a head checkpoint.

Contract with the model runner, once per step after verification: `propose(batch)` returns, for
each request that sampled this step (`batch.sample_idx`, in that order), up to k draft tokens
to verify next step, and for drafts drawn at random the distribution q each was drawn from
(the rejection sampler needs it). The runner has already appended the step's accepted tokens
to each request's `token_ids`, so for request i the positions `start[i] .. start[i] +
num_valid[i] - 1` hold tokens whose target KV is now valid (the scheduler rolled back the
rest), and when it sampled, its last token `token_ids[-1]` sits at position `start[i] +
num_valid[i]`.

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
from pagedllm.attention.layer import allocate_kv_caches, kv_cache_bytes_per_block
from pagedllm.sample import ops
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.spec_decode.rejection_sampler import target_probs

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
    block_table: np.ndarray  # [B, max_blocks] int32 the step's block table (zero padded)


@dataclass
class Proposal:
    """Drafts of the requests that sampled, in `DraftBatch.sample_idx` order (or, from
    `run_proposer`, of every request in batch order)."""

    token_ids: list[list[int]]  # [S] up to k drafts each
    # [S] float32 [n, V] per request, row j the distribution draft j + 1 was drawn from; None
    # where the drafts are argmax picks (q one-hot). None: all are.
    probs: list[torch.Tensor | None] | None = None


class Proposer:
    """Drafts k tokens per sampling request (see the module docstring)."""

    def load_model(self, target_model: nn.Module) -> None:
        """Load the proposer's weights (may share modules with the target)."""

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, backend: AttentionBackend) -> None:
        """Allocate the proposer's own KV tensors over `num_blocks` shared block ids."""

    def propose(self, batch: DraftBatch) -> Proposal:
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
        self.kv_cache_dtype = config.kv_cache_torch_dtype  # the target's: one backend reads both
        self.model: nn.Module | None = None
        self.backend: AttentionBackend | None = None
        self.kv_caches: list[torch.Tensor] = []

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.model, self.block_size, self.kv_cache_dtype)

    def initialize_kv_cache(self, num_blocks: int, backend: AttentionBackend) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model, backend, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        self.backend = backend

    def attention_metadata(
        self, block_table: np.ndarray, first_pos: np.ndarray, num_rows: np.ndarray
    ) -> tuple[Any, torch.Tensor]:
        """Metadata for running `num_rows[r]` tokens of request r at positions `first_pos[r]`,
        `first_pos[r] + 1`, ... over `block_table [R, max_blocks]` -> (metadata, positions).

        Positions past max_model_len - 1 (drafts the scheduler would drop anyway) are clamped to
        it: they stay inside the slots the scheduler reserved and inside the RoPE table."""
        common, positions = CommonAttentionMetadata.for_spans(
            block_table, first_pos, num_rows, self.block_size, self.device, self.max_model_len - 1
        )
        return self.backend.build_metadata(common), torch.from_numpy(positions).to(self.device)

    def draft(
        self,
        batch: DraftBatch,
        counts: np.ndarray,
        first_out: torch.Tensor,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
        step_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor],
    ) -> Proposal:
        """The drafts, after a first pass over `counts [B]` rows per request whose outputs are
        `first_out [N, H]`: draft 1 comes from each sampling request's last row, drafts 2..k
        from one-row passes `step_fn(tokens, previous outputs, positions, metadata)`;
        `logits_fn` maps outputs to draft logits."""
        idx = batch.sample_idx
        if idx.size == 0:
            return Proposal([])
        sample_states = [batch.states[i] for i in idx.tolist()]
        limits = draft_limits(sample_states, self.k)
        draw = DraftSampler(sample_states, limits, self.device)
        out = first_out[torch.from_numpy(np.cumsum(counts)[idx] - 1).to(self.device)]  # [S, H]
        token = draw(logits_fn(out))  # [S]
        drafts = [token]
        next_pos = batch.start[idx] + counts[idx]  # [S] position of draft 1's row
        sub_table = batch.block_table[idx]
        ones = np.ones(len(idx), dtype=np.int64)
        for j in range(1, max(limits, default=0)):
            meta, positions = self.attention_metadata(sub_table, next_pos + (j - 1), ones)
            out = step_fn(token, out, positions, meta)
            token = draw(logits_fn(out))
            drafts.append(token)
        return draw.proposal(drafts)


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


def run_proposer(proposer: Proposer, batch: DraftBatch) -> Proposal:
    """Run `proposer` on the step's batch -> drafts per request in batch order ([] and None
    for those that did not sample), each cut to its `draft_limits`."""
    tokens: list[list[int]] = [[] for _ in batch.states]
    probs: list[torch.Tensor | None] = [None] * len(batch.states)
    idx = batch.sample_idx.tolist()
    proposal = proposer.propose(batch)
    limits = draft_limits([batch.states[i] for i in idx], 1 << 30)
    q = proposal.probs or [None] * len(idx)
    for i, d, p, n in zip(idx, proposal.token_ids, q, limits):
        tokens[i] = list(d[:n])
        probs[i] = p[:n] if p is not None and n > 0 else None
    return Proposal(tokens, probs)


class DraftSampler:
    """Picks the draft tokens of one `propose` call, one draft position per call.

    A request that samples (temperature > 0) draws draft j from q_j: the draft model's logits
    under the request's temperature, min-p, top-k and top-p, processed as the target's are
    (`target_probs`; penalties, bans and bias are left to the target: they cost acceptance,
    never correctness), from its own generator when seeded; q_j is kept for the rejection
    sampler. Greedy requests take the argmax (q one-hot). So do structured-output requests:
    the scheduler cuts their drafts at the first one the grammar refuses, a cut that depends
    on the drafted tokens; with a one-hot q it is exact (a refused draft has p = 0, and the
    target's resample from p minus the draft is p itself), with a sampled q it would bias the
    output. A seeded request draws only for the drafts it may keep (`limits`), so its
    generator does not depend on the other requests of the batch."""

    def __init__(self, states: list[Any], limits: list[int], device: torch.device) -> None:
        self.states = states
        self.limits = limits
        self.device = device
        self.rows = [
            i
            for i, s in enumerate(states)
            if limits[i] > 0
            and s.sampling_params.temperature > 0
            and s.sampling_params.structured_outputs is None
        ]
        self.rows_t = torch.tensor(self.rows, dtype=torch.int64).to(device)
        self.metadata: SamplingMetadata | None = None
        self.probs: list[torch.Tensor] = []  # per draft position: [R, V] q of the random rows

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 draft logits `[S, V]` at the next draft position -> tokens [S] int64."""
        tokens = ops.argmax(logits)
        if not self.rows:
            return tokens
        if self.metadata is None:
            # Only temperature / min-p / top-k / top-p and the generators are read: no history.
            empty = [[] for _ in self.rows]
            self.metadata = SamplingMetadata.build(
                [self.states[i].sampling_params for i in self.rows],
                empty,
                empty,
                [self.states[i].generator for i in self.rows],
                vocab_size=logits.shape[-1],
                device=self.device,
            )
        j = len(self.probs)
        generators = {
            r: g for r, g in self.metadata.generators.items() if self.limits[self.rows[r]] > j
        }
        probs = target_probs(logits[self.rows_t], self.metadata)  # [R, V]
        tokens[self.rows_t] = ops.random_sample(probs, generators)
        self.probs.append(probs)
        return tokens

    def proposal(self, drafts: list[torch.Tensor]) -> Proposal:
        """The tokens of every call so far (`drafts`, [S] each) -> `Proposal`, each request's
        drafts cut to its limit."""
        rows = torch.stack(drafts, dim=1).tolist()  # [S, num_steps]
        token_ids = [row[:n] for row, n in zip(rows, self.limits)]
        if not self.rows:
            return Proposal(token_ids)
        q = torch.stack(self.probs, dim=1)  # [R, num_steps, V]
        probs: list[torch.Tensor | None] = [None] * len(self.limits)
        for r, i in enumerate(self.rows):
            probs[i] = q[r, : self.limits[i]]
        return Proposal(token_ids, probs)


# ---- loading a head checkpoint --------------------------------------------------------------


def checkpoint_tensor_names(model_dir: str, load_format: str = "auto") -> set[str]:
    """Names of the tensors in a checkpoint directory (the files `load_format` reads),
    without reading the safetensors ones' tensors."""
    from pagedllm.models.loader import iterate_weights, list_weight_files

    names: set[str] = set()
    for path in list_weight_files(model_dir, load_format):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.update(f.keys())
        else:
            names.update(name for name, _ in iterate_weights(path.parent, load_format))
            break
    return names


def load_head(
    build: Callable[[], nn.Module],
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
) -> nn.Module:
    """A draft head (EAGLE, Medusa) built by `build` and loaded from `model_dir`'s files of
    `load_format` (`models.loader.load_module`)."""
    from pagedllm.models.loader import load_module

    source = f"speculative_config.model={model_dir!r}"
    return load_module(build, model_dir, dtype, device, source, load_format=load_format)
