"""Reasoning parsers (`--reasoning-parser`): split a reasoning model's thinking from its
answer. One parser a file; `ReasoningParserManager` looks them up by vLLM's names."""

from pagedllm.reasoning.abs_reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserManager,
)

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningParserManager"]
