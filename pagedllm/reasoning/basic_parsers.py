"""`BaseThinkingReasoningParser`: reasoning between a start and an end token.

Both markers must be single tokens of the vocabulary (they are in every model that uses
them); the token ids decide where the reasoning ends, the text splits on the markers' text.
A missing start marker in the output is fine (templates often put it in the prompt): the
reasoning runs from the start of the output to the end marker. No end marker means the
output stopped while still reasoning, so all of it is reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningDelta, ReasoningParser


class BaseThinkingReasoningParser(ReasoningParser):
    """Reasoning is the text before `end_token` (a leading `start_token` removed)."""

    start_token: str = "<think>"
    end_token: str = "</think>"

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        super().__init__(tokenizer, chat_template_kwargs)
        ids = tokenizer.convert_tokens_to_ids([self.start_token, self.end_token])
        found = tokenizer.convert_ids_to_tokens([i if i is not None else 0 for i in ids])
        missing = [t for t, f in zip((self.start_token, self.end_token), found) if t != f]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs the tokens {missing} in the tokenizer's "
                "vocabulary; this model does not use them"
            )
        self.start_token_id, self.end_token_id = ids

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        # The last marker decides: a prompt may hold earlier turns' closed think blocks.
        for token_id in reversed(input_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        return self.end_token_id in delta_ids

    def _strip_start(self, text: str) -> str:
        return text.replace(self.start_token, "")

    def extract_reasoning_content(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        reasoning, found, content = model_output.partition(self.end_token)
        reasoning = self._strip_start(reasoning)
        if not found:
            return reasoning or None, None
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> ReasoningDelta | None:
        """Call while `previous_text` is still reasoning (it holds no end marker). The
        result's content is not None (maybe "") once the end marker has been read; from then
        on the rest of the output is content."""
        # The marker can newly appear only in the delta (or straddle into it).
        at = current_text.find(self.end_token, max(0, len(previous_text) - len(self.end_token)))
        if at < 0:
            reasoning = self._strip_start(delta_text)
            return ReasoningDelta(reasoning, None) if reasoning else None
        reasoning = self._strip_start(current_text[len(previous_text) : at])
        return ReasoningDelta(reasoning or None, current_text[at + len(self.end_token) :])
