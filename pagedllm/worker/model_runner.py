"""ModelRunner: turns a `SchedulerOutput` into one model forward and a `ModelRunnerOutput`.

Each step it (1) updates its per-request state from the scheduler's deltas (new, resumed,
continuing, finished, preempted requests), (2) flattens the new tokens of every scheduled
request into one sequence with numpy (input ids, positions, slot mapping, block table,
query offsets, sequence lengths; no per-token Python loop), (3) runs the model once, (4) takes
logits only at the last token of each request whose scheduled tokens reach the end of its known
tokens (a partial prefill chunk does not sample), and (5) samples. The runner never decides who
runs; it only executes what the scheduler chose.

With several ranks, every rank runs (1)-(3) on its shard (tensor parallel) or its layers
(pipeline parallel: a stage before the last sends its activations to the next and stops
there). Only the *driver*, the first tensor-parallel rank of the last stage, samples, drafts
and returns a `ModelRunnerOutput`; the last stage's other ranks help compute the logits
(their vocabulary slices are gathered on the driver) and return None. The ranks that did not
sample learn the new tokens from the next `SchedulerOutput`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.layer import (
    allocate_kv_caches,
    get_attention_layers,
    kv_cache_bytes_per_block,
)
from pagedllm.attention.selector import get_attn_backend
from pagedllm.compilation.compile import compile_model
from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.distributed import get_pp_group, get_tp_group, single_process_groups
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    execute_with_kv_connector,
)
from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory
from pagedllm.distributed.kv_transfer.kv_blocks import kv_block_dim
from pagedllm.layers.batch_invariant import make_batch_invariant_, reseed_for_token
from pagedllm.layers.cpu_memory import HugePageMove
from pagedllm.models.loader import get_model, weight_huge_pages
from pagedllm.models.pipeline import IntermediateTensors
from pagedllm.outputs import BeamCandidates, LogprobsLists, ModelRunnerOutput
from pagedllm.sample.beam import beam_candidates
from pagedllm.sample.logprobs import compute_token_logprobs
from pagedllm.sample.metadata import SamplingMetadata, TokenHistory
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import get_speculative_config
from pagedllm.spec_decode.proposer import DraftBatch, make_proposer, run_proposer
from pagedllm.spec_decode.rejection_sampler import RejectionSampler
from pagedllm.spec_decode.verifier import verification_rows, verify_and_sample
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.cuda_graph import CUDAGraphRunner, capture_sizes, use_cuda_graphs
from pagedllm.worker.kv_prefault import KVPrefaulter

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    # Prompt positions whose logprobs were already returned (prompt_logprobs requests).
    num_prompt_logprobs_done: int = 0
    # q [n, V] of the drafts last proposed for it, when they were sampled (spec decoding).
    draft_probs: torch.Tensor | None = None
    # Beam search: > 0 means return this many next-token candidates instead of sampling.
    num_beam_candidates: int = 0
    token_ids: list[int] = field(init=False)
    # The tokens as the penalties read them, kept up to date step by step.
    history: TokenHistory = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids
        self.history = TokenHistory(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.token_ids.extend(token_ids)

    def set_tokens(self, start: int, token_ids: list[int]) -> None:
        """Set the tokens at positions [start, start + len(token_ids)), extending the
        request where they run past its end (a continuation the scheduler chose)."""
        self.token_ids[start : start + len(token_ids)] = token_ids
        num_prompt = len(self.prompt_token_ids)
        if start + len(token_ids) > num_prompt:
            skip = max(num_prompt - start, 0)
            out_start = start + skip - num_prompt
            new = token_ids[skip:]
            held = self.output_token_ids[out_start : out_start + len(new)]
            if held != new[: len(held)]:  # outputs it holds rewritten (a beam's continuation)
                self.history = TokenHistory(self.prompt_token_ids)
            self.output_token_ids[out_start : out_start + len(new)] = new


@dataclass
class _StepBatch:
    """One step's scheduled requests (B of them, T flattened rows), built once per step."""

    req_ids: list[str]
    states: list[CachedRequestState]
    start: np.ndarray  # [B] int64 first position run this step (num_computed_tokens)
    num_sched: np.ndarray  # [B] int64 tokens scheduled
    row_start: np.ndarray  # [B] int64 first row of each request in the flattened batch
    drafts: list[list[int]]  # [B] draft tokens under verification
    num_drafts: np.ndarray  # [B] int64
    block_table: np.ndarray  # [B, max_blocks] int32, zero padded


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.dtype = config.model_config.dtype
        self.kv_cache_dtype = config.kv_cache_torch_dtype  # the model's, or fp8
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(batch_invariant=config.batch_invariant)
        self.attn_backend = get_attn_backend(
            device,
            self.kv_cache_dtype,
            config.attention_backend,
            config.batch_invariant,
            model_dtype=self.dtype,
        )
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_prefaulter: KVPrefaulter | None = None  # CPU caches' pages, while idle
        self.weight_move: HugePageMove | None = None  # CPU weights onto huge pages, while idle
        self.cuda_graphs: CUDAGraphRunner | None = None  # captured mode (capture_model)
        self.pp_group = get_pp_group()
        self.is_driver = self.pp_group.is_last_rank and get_tp_group().is_first_rank
        # Speculative decoding (spec_decode/): a proposer drafts, the RejectionSampler verifies.
        # Only the driver drafts: it alone knows the accepted tokens drafting starts from.
        spec = get_speculative_config(config)
        self.drafter = None
        if spec is not None and self.is_driver:
            self.drafter = make_proposer(config, spec, device)
        self.rejection_sampler = RejectionSampler()
        # (request states, their SamplingMetadata) of the last plain sampling step.
        self._cached_metadata: tuple[list[CachedRequestState], SamplingMetadata] | None = None
        # The worker side of a KV connector (distributed/kv_transfer/), None without one.
        self.kv_connector: KVConnectorBase_V1 | None = None
        if config.kv_transfer_config is not None:
            self.kv_connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)

    # ---- set-up ----------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = get_model(self.config)
        if weight_huge_pages(self.device):
            self.weight_move = HugePageMove(self.model)
        compile_model(self.model, self.config.compilation_config)
        if self.config.batch_invariant:
            make_batch_invariant_(self.model)
        if not get_attention_layers(self.model):
            raise RuntimeError("the model has no Attention layers to bind a KV cache to")
        if self.drafter is None:
            return
        if self.config.parallel_config.world_size == 1:
            self.drafter.load_model(self.model)
            return
        # The driver keeps its drafter whole: built and run outside the process groups, with
        # an unsharded copy of the target's embedding and LM head for the heads that share them.
        from pagedllm.spec_decode.target_heads import load_target_heads

        with single_process_groups():
            self.drafter.load_model(load_target_heads(self.config, self.device))

    def kv_cache_bytes_per_block(self) -> int:
        per_layer = kv_cache_bytes_per_block(self.model, self.block_size, self.kv_cache_dtype)
        if self.drafter is not None:  # a draft model / EAGLE head keeps its own KV per block
            per_layer += self.drafter.kv_cache_bytes_per_block()
        return per_layer

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one paged KV tensor per attention layer and bind it to the layer."""
        self.kv_caches = allocate_kv_caches(
            self.model,
            self.attn_backend,
            num_blocks,
            self.block_size,
            self.kv_cache_dtype,
            self.device,
        )
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, self.attn_backend)
        if self.device.type == "cpu":
            drafts = getattr(self.drafter, "kv_caches", [])  # a draft model's / EAGLE's
            block_dim = kv_block_dim(self.attn_backend)
            self.kv_prefaulter = KVPrefaulter(self.kv_caches + drafts, block_dim)
        if self.kv_connector is not None:
            layers = get_attention_layers(self.model)
            self.kv_connector.register_kv_caches(
                {layer.layer_name: layer.kv_cache for layer in layers},
                kv_block_dim(self.attn_backend),
                {layer.layer_name: (layer.kv_scales.k, layer.kv_scales.v) for layer in layers},
            )
            for layer in layers:
                layer.kv_connector = self.kv_connector

    @contextmanager
    def scratch_prompts(
        self, lens: np.ndarray
    ) -> Iterator[tuple[CommonAttentionMetadata, torch.Tensor]]:
        """Fresh prompts of `lens` tokens (int64 [R], each from position 0) over a scratch KV
        cache bound to the model's layers for the block (dropped after it; initialize_kv_cache
        binds the real one): (their metadata, positions) for a start-up forward (the GPU
        memory profile, the calibration of calculate_kv_scales)."""
        bs, device = self.block_size, self.device
        blocks = -(-lens // bs)  # [R]
        table = np.zeros((len(lens), int(blocks.max())), dtype=np.int32)
        table[np.arange(table.shape[1]) < blocks[:, None]] = np.arange(int(blocks.sum()))
        try:
            allocate_kv_caches(
                self.model, self.attn_backend, int(blocks.sum()), bs, self.kv_cache_dtype, device
            )
            common, positions = CommonAttentionMetadata.for_spans(
                table, np.zeros(len(lens), dtype=np.int64), lens, bs, device
            )
            yield common, torch.from_numpy(positions).to(device)
        finally:
            for layer in get_attention_layers(self.model):
                layer.kv_cache = None

    def idle_work(self) -> bool:
        """One piece of what an idle engine does; whether any remains: first the move of the
        packed CPU weights onto huge pages (layers/cpu_memory.py; every step after it streams
        them faster), then the CPU KV cache's pages (worker/kv_prefault.py)."""
        if self.weight_move is not None:
            if self.weight_move.step():
                return True
            self.weight_move = None
        return self.kv_prefaulter is not None and self.kv_prefaulter.step()

    def finish_weight_move(self) -> None:
        """Finish the weights' move onto huge pages now (an engine without idle time)."""
        if self.weight_move is not None:
            self.weight_move.finish()
            self.weight_move = None

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def capture_model(self) -> None:
        """Capture the decode forward in CUDA graphs (worker/cuda_graph.py) where captured
        mode applies: on CUDA, without enforce_eager, with a capturable attention backend."""
        if not use_cuda_graphs(self.config, self.device, self.attn_backend):
            return
        self.cuda_graphs = CUDAGraphRunner(
            lambda inputs, meta: self.model(inputs["input_ids"], inputs["positions"], meta),
            self.attn_backend,
            capture_sizes(self.config),
            {"input_ids": (torch.int64, ()), "positions": (torch.int64, ())},
            max_blocks_per_req=-(-self.config.model_config.max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
        )
        self.cuda_graphs.capture()

    # ---- per-step state ---------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and params.temperature > 0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
                num_beam_candidates=new.num_beam_candidates,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.new_block_ids[i]:
                state.block_ids.extend(cached.new_block_ids[i])
            if cached.new_token_ids and cached.new_token_ids[i]:
                state.set_tokens(cached.new_token_start[i], cached.new_token_ids[i])
        for copy in so.blocks_to_copy:  # copy-on-write: the request now owns dst
            state = self.requests.get(copy.req_id)
            if state is not None:
                state.block_ids[copy.block_index] = copy.dst_block_id

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on the driver; None on the other ranks (see the module
        docstring)."""
        if self.kv_connector is not None:
            return execute_with_kv_connector(self.kv_connector, so, self._execute_model)
        return self._execute_model(so)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            if not self.is_driver:
                return None
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        if so.blocks_to_copy:
            self._copy_blocks(so)
        step = self._step_batch(so)
        common, input_ids, positions = self._prepare_inputs(step)
        hidden = self.forward(common, input_ids, positions)  # [T, hidden]
        if hidden is None:
            return None  # a pipeline stage before the last

        # A request samples when this step's tokens reach the end of its known tokens; one with
        # draft tokens verifies them and may emit up to k + 1 (see _sample_tokens).
        sampling_start = time.perf_counter()
        sampled, logprobs, beam_candidates = self._sample_tokens(so, step, hidden)
        prompt_logprobs = self._prompt_logprobs(step, hidden)
        if not self.is_driver:
            return None
        spec_token_ids = None
        if self.drafter is not None:
            spec_token_ids = self._propose_drafts(step, hidden, sampled)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs_dict=prompt_logprobs,
            spec_token_ids=spec_token_ids,
            beam_candidates=beam_candidates,
            sampling_time_s=time.perf_counter() - sampling_start,
        )

    def _copy_blocks(self, so: SchedulerOutput) -> None:
        """Run the step's copy-on-write block copies (before anything writes this step)."""
        src = torch.tensor([c.src_block_id for c in so.blocks_to_copy], device=self.device)
        dst = torch.tensor([c.dst_block_id for c in so.blocks_to_copy], device=self.device)
        self.attn_backend.copy_blocks(self.kv_caches, src, dst)

    def _step_batch(self, so: SchedulerOutput) -> _StepBatch:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(req_ids)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int64, num_reqs)
        spec = so.scheduled_spec_decode_tokens
        drafts = [spec.get(r, []) for r in req_ids] if spec else [[] for _ in req_ids]
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        # Block table [num_reqs, max_blocks]: each request's block ids, zero-padded.
        num_blocks = np.fromiter((len(s.block_ids) for s in states), np.int64, num_reqs)
        block_table = np.zeros((num_reqs, int(num_blocks.max())), dtype=np.int32)
        block_table[np.arange(block_table.shape[1]) < num_blocks[:, None]] = np.fromiter(
            itertools.chain.from_iterable(s.block_ids for s in states), np.int32
        )
        return _StepBatch(
            req_ids=req_ids,
            states=states,
            start=np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs),
            num_sched=num_sched,
            row_start=cu[:-1],
            drafts=drafts,
            num_drafts=np.fromiter(map(len, drafts), np.int64, num_reqs),
            block_table=block_table,
        )

    def _sample_tokens(
        self, so: SchedulerOutput, step: _StepBatch, hidden: torch.Tensor
    ) -> tuple[list[list[int]], list[LogprobsLists | None], dict[str, BeamCandidates]]:
        """Sample every request whose scheduled tokens reach the end of its known tokens and
        append the result to its state. A request with k draft tokens scheduled owns the last
        k + 1 rows: the `RejectionSampler` verifies the drafts there and emits the accepted
        ones plus one (spec_decode/verifier.py); without drafts anywhere in the batch the
        plain `Sampler` samples one token per request from its last row. Beams of a beam
        search return their candidates instead (their scheduler picks)."""
        states = step.states
        ends = (step.start + step.num_sched).tolist()
        sample_rows = [i for i, (s, end) in enumerate(zip(states, ends)) if end >= s.num_tokens]
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list[LogprobsLists | None] = [None] * len(states)
        beam_rows = [i for i in sample_rows if states[i].num_beam_candidates]
        candidates = self._beam_candidates(step, hidden, beam_rows) if beam_rows else {}
        if beam_rows:
            sample_rows = [i for i in sample_rows if not states[i].num_beam_candidates]
        if not sample_rows:
            return sampled, logprobs, candidates
        num_drafts = step.num_drafts[sample_rows]
        last_rows = (step.row_start + step.num_sched)[sample_rows] - 1
        rows = verification_rows(last_rows, num_drafts)
        # The rows are distinct and increasing, so as many as hidden has are all of them in
        # order (a decode-only step): no gather (a few ops that a batch-1 step runs on caches
        # its weights have just flushed; 1.01-1.02x int8 batch-1 decode, alternated).
        if len(rows) == hidden.shape[0]:
            picked = hidden
        else:
            picked = hidden[torch.from_numpy(rows).to(self.device)]
        logits = self.model.compute_logits(picked)
        if logits is None:  # a tensor-parallel rank that only helped compute them
            return sampled, logprobs, candidates
        if so.grammar_bitmask is not None:  # structured outputs: mask what grammars forbid
            # One bitmask row per verified position, in the order of `rows`.
            sample_ids = [step.req_ids[i] for i in sample_rows]
            apply_grammar_bitmask(logits, so, sample_ids, num_drafts + 1)
        sample_states = [states[i] for i in sample_rows]
        if num_drafts.any():
            token_lists, row_logprobs = verify_and_sample(
                logits,
                [step.drafts[i] for i in sample_rows],
                [s.sampling_params for s in sample_states],
                [s.prompt_token_ids for s in sample_states],
                [s.output_token_ids for s in sample_states],
                [s.generator for s in sample_states],
                self.rejection_sampler,
                [s.draft_probs for s in sample_states],
            )
        else:
            token_ids, row_logprobs = self._sample(logits, sample_states)
            token_lists = [[t] for t in token_ids]
        for j, i in enumerate(sample_rows):
            sampled[i] = token_lists[j]
            states[i].append_output(sampled[i])
            logprobs[i] = row_logprobs[j] if row_logprobs is not None else None
        return sampled, logprobs, candidates

    def _beam_candidates(
        self, step: _StepBatch, hidden: torch.Tensor, rows: list[int]
    ) -> dict[str, BeamCandidates]:
        last_rows = (step.row_start + step.num_sched)[rows] - 1
        logits = self.model.compute_logits(hidden[torch.from_numpy(last_rows).to(self.device)])
        if logits is None:  # not the driver
            return {}
        states = [step.states[i] for i in rows]
        results = beam_candidates(
            logits,
            [s.num_beam_candidates for s in states],
            [s.sampling_params.temperature for s in states],
        )
        return {s.req_id: r for s, r in zip(states, results)}

    def _propose_drafts(
        self, step: _StepBatch, hidden: torch.Tensor, sampled: list[list[int]]
    ) -> list[list[int]]:
        """Draft the next step's tokens of every request that sampled (spec_decode/) and keep
        their q for verifying them; the proposer also refreshes its own KV for every position
        the target computed validly: all scheduled rows but the rejected drafts."""
        num_emitted = np.fromiter(map(len, sampled), dtype=np.int64, count=len(sampled))
        batch = DraftBatch(
            states=step.states,
            start=step.start,
            num_valid=step.num_sched - step.num_drafts + np.maximum(num_emitted - 1, 0),
            row_start=step.row_start,
            sample_idx=np.flatnonzero(num_emitted),
            hidden=hidden,
            block_table=step.block_table,
        )
        proposal = run_proposer(self.drafter, batch)
        for i in batch.sample_idx.tolist():
            step.states[i].draft_probs = proposal.probs[i]
        return proposal.token_ids

    def forward(
        self, common: CommonAttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The model over this stage's layers. The last stage returns hidden states [T, H]: a
        captured CUDA graph's replay for a decode batch that fits one, else an eager forward.
        An earlier stage sends its activations on to the next stage and returns None."""
        graphs = self.cuda_graphs
        size = graphs.size_for(common) if graphs is not None else None
        if size is not None:  # captured mode runs only in a world of one (use_cuda_graphs)
            inputs = {"input_ids": input_ids, "positions": positions}
            return graphs.run(size, inputs, common)
        pp = self.pp_group
        intermediate = None
        if not pp.is_first_rank:
            intermediate = self.model.make_empty_intermediate_tensors(
                input_ids.shape[0], self.dtype, self.device
            )
            pp.recv_tensors(intermediate.tensors())
        attn_meta = self.attn_backend.build_metadata(common)
        out = self.model(input_ids, positions, attn_meta, intermediate)
        if isinstance(out, IntermediateTensors):
            pp.send_tensors(out.tensors())
            return None
        return out

    def _prepare_inputs(
        self, step: _StepBatch
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        tokens: list[int] = []
        spans = zip(step.states, step.start.tolist(), step.num_sched.tolist(), step.drafts)
        for s, a, n, drafts in spans:
            known = s.token_ids[a : a + n]
            tokens.extend(known)
            if len(known) < n:  # draft tokens under verification
                tokens.extend(drafts[: n - len(known)])
        dev = self.device
        common, positions = CommonAttentionMetadata.for_spans(
            step.block_table, step.start, step.num_sched, self.block_size, dev
        )
        return (
            common,
            torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(dev),
            torch.from_numpy(positions).to(dev),
        )

    def _sample(
        self, logits: torch.Tensor, states: list[CachedRequestState]
    ) -> tuple[list[int], list[LogprobsLists | None] | None]:
        if self.config.batch_invariant:
            for s in states:
                if s.generator is not None:
                    reseed_for_token(s.generator, s.sampling_params.seed, len(s.output_token_ids))
        metadata = self._sampling_metadata(states, logits.shape[-1])
        out = self.sampler(logits, metadata, overwrite=True)  # the logits are ours to spend
        token_ids = out.sampled_token_ids.tolist()
        row_logprobs = None
        if out.logprobs is not None:
            row_logprobs = out.logprobs.to_lists(metadata.num_logprobs)
        return token_ids, row_logprobs

    def _sampling_metadata(
        self, states: list[CachedRequestState], vocab_size: int
    ) -> SamplingMetadata:
        """The rows' SamplingMetadata; last step's when it sampled the very same request
        states (objects, so a resumed request counts as new) and nothing in it depends on
        their output tokens, as in a steady decode batch."""
        cached = self._cached_metadata
        if (
            cached is not None
            and cached[1].reusable
            and len(cached[0]) == len(states)
            and all(a is b for a, b in zip(cached[0], states))
        ):
            return cached[1]
        metadata = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            vocab_size=vocab_size,
            device=self.device,
            histories=[s.history for s in states],
        )
        self._cached_metadata = (states, metadata)
        return metadata

    def _prompt_logprobs(self, step: _StepBatch, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens 1..P-1 covered by this step's chunk (position p's hidden
        state predicts token p+1)."""
        result: dict[str, LogprobsLists] = {}
        for i, s in enumerate(step.states):
            k = s.sampling_params.prompt_logprobs
            if k is None:
                continue
            first = int(step.start[i])
            a = max(first, s.num_prompt_logprobs_done)
            b = min(first + int(step.num_sched[i]), len(s.prompt_token_ids) - 1)
            if b <= a:
                continue
            row0 = int(step.row_start[i])
            rows = hidden[row0 + (a - first) : row0 + (b - first)]
            logits = self.model.compute_logits(rows)
            s.num_prompt_logprobs_done = b
            if logits is None:  # not the driver
                continue
            targets = torch.as_tensor(s.prompt_token_ids[a + 1 : b + 1], device=self.device)
            lp = compute_token_logprobs(logits, targets, k)
            result[s.req_id] = lp.tolists()
        return result
