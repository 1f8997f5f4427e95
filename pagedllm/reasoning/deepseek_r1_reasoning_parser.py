"""DeepSeek-R1 (`--reasoning-parser deepseek_r1`): `<think>` ... `</think>`, then the answer.

R1's chat template opens the think block in the prompt, so the output usually starts inside
it and only `</think>` appears; everything before it is reasoning.
"""

from __future__ import annotations

from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """Reasoning up to `</think>`; without one, the whole output is reasoning."""

    start_token = "<think>"
    end_token = "</think>"
