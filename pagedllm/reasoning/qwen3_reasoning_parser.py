"""Qwen3 (`--reasoning-parser qwen3`): `<think>` ... `</think>`, then the answer.

Qwen3 writes `<think>` itself (later templates put it in the prompt); both are handled by the
base class. Thinking is on unless the request's `chat_template_kwargs` say
`enable_thinking: false`: then the template closes an empty think block in the prompt, and an
output without `</think>` is all content, never reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """`<think>` / `</think>`, honouring `enable_thinking=False`."""

    start_token = "<think>"
    end_token = "</think>"

    @property
    def thinking_enabled(self) -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True))

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return not self.thinking_enabled or super().is_reasoning_end(input_ids)

    def extract_reasoning_content(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        if not self.thinking_enabled and self.end_token not in model_output:
            return None, model_output or None
        return super().extract_reasoning_content(model_output, request)
