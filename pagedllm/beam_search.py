"""Beam search's public types and its ranking rule (vLLM's names: `BeamSearchSequence`,
`BeamSearchOutput`, `get_beam_search_score`).

The search itself runs inside the engine core (`core/sched/beam.py`); `LLM.beam_search`
returns one `BeamSearchOutput` per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One finished beam. `tokens` holds the prompt followed by the output tokens (vLLM's
    layout; a final EOS only with `include_stop_str_in_output`); `logprobs[i]` maps the i-th
    output position's chosen token and the candidates scored there to their `Logprob`;
    `text` decodes `tokens` (prompt included, as vLLM's `LLM.beam_search` does)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | None,
    length_penalty: float = 1.0,
) -> float:
    """`cumulative_logprob / seq_len ** length_penalty`, where `seq_len` counts the prompt and
    the output but not a final EOS (transformers' and vLLM's rule). `length_penalty > 1`
    favours longer sequences, `< 1` shorter ones."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)
