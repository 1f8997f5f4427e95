"""What a reasoning parser is, and the registry of them (`--reasoning-parser NAME`).

A reasoning model writes its thinking first, between markers such as `<think>` and
`</think>`, then its answer. A `ReasoningParser` splits the generated text into the two
(`extract_reasoning_content`, and `extract_reasoning_content_streaming` for deltas), and tells
from token ids whether the thinking is over (`is_reasoning_end`): the front end uses that on
the prompt (a template that closes the think block, e.g. `enable_thinking=False`, leaves
nothing to split), and the engine core's `StructuredOutputManager` uses it to start a
request's grammar only after the reasoning ends.

Parsers are looked up by vLLM's names through `ReasoningParserManager.get_reasoning_parser`;
the table below is constant (name -> module, class), imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, NamedTuple

# vLLM's parser names -> (module under pagedllm.reasoning, class).
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("deepseek_r1_reasoning_parser", "DeepSeekR1ReasoningParser"),
    "qwen3": ("qwen3_reasoning_parser", "Qwen3ReasoningParser"),
}


class ReasoningDelta(NamedTuple):
    """What one streamed delta adds to the reasoning and to the content (None: nothing)."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Splits reasoning from content for one tokenizer. Stateless: one instance serves any
    number of requests. `chat_template_kwargs` are the request's (some parsers read
    `enable_thinking`)."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over after `input_ids` (a prompt, or prompt + output)."""
        raise NotImplementedError

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        """Whether `delta_ids`, just appended to `input_ids`, end the reasoning (cheap: the
        engine calls it once per generated token while a request reasons)."""
        raise NotImplementedError

    def extract_reasoning_content(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where a part is empty."""
        raise NotImplementedError

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> ReasoningDelta | None:
        """What `delta_text` adds to reasoning and content (None: nothing to send yet). Called
        while the reasoning is not over; a result whose content is not None ends it."""
        raise NotImplementedError


class ReasoningParserManager:
    """vLLM's lookup of reasoning parsers by name."""

    @staticmethod
    def get_reasoning_parser(name: str) -> type[ReasoningParser]:
        """The parser class registered as `name`; ValueError naming the valid ones."""
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={name!r} is not available; choose one of "
                f"{sorted(REASONING_PARSERS)}"
            )
        module, cls = REASONING_PARSERS[name]
        return getattr(importlib.import_module(f"pagedllm.reasoning.{module}"), cls)
