"""Speculative decoding: proposers draft k tokens per request, the target verifies them.

Map of the package:
- `config.py`: `SpeculativeConfig` (vLLM's fields), `get_speculative_config(EngineConfig)`.
- `proposer.py`: the `Proposer` interface, the per-step `DraftBatch` and the `Proposal`,
  `make_proposer`, and what model-based proposers share (`DraftSampler`: argmax or a sample
  of q per request; paged KV cache over the target's blocks; head loading).
- `ngram_proposer.py`, `draft_model.py`, `eagle.py`, `medusa.py`: the four proposers.
- `rejection_sampler.py`: `RejectionSampler`, batched accept / reject / resample.
- `verifier.py`: what the model runner calls to verify drafts and sample up to k + 1 tokens.
- `metrics.py`: acceptance counters (scheduler side) and their logging / Prometheus views.
- `testing.py`: random EAGLE / Medusa checkpoints for tests and benchmarks.

The scheduler side needs no module here: drafts live in `Request.spec_token_ids` (a structured
request's cut to what its grammar accepts, `StructuredOutputManager.validate_tokens`), are
scheduled as ordinary new tokens (with `num_lookahead_tokens` = k extra KV slots reserved), and
`Scheduler.update_from_output` rolls back the rejected ones. The runner keeps each request's
q between the step that drafts and the step that verifies (`CachedRequestState.draft_probs`).
"""

from pagedllm.spec_decode.config import SpeculativeConfig, get_speculative_config

__all__ = ["SpeculativeConfig", "get_speculative_config"]
