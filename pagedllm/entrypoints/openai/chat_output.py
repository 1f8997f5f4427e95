"""`ChatOutputParser`: one chat choice's generated text split into reasoning, content and
tool calls, for a whole output (`parse`) or delta by delta (`feed`, then `finish`).

The reasoning parser (`--reasoning-parser`) goes first: while the model reasons, text is
reasoning; the rest is content. A prompt whose template already closed the reasoning
(`enable_thinking=False`) makes all of it content. The content then goes through the
request's tool parser (tool_choice.py picks it), if any. Streamed pieces concatenate to what
`parse` returns for the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.protocol import DeltaMessage
from pagedllm.entrypoints.openai.protocol_tools import ToolCall
from pagedllm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser
from pagedllm.reasoning import ReasoningParser


@dataclass
class ParsedMessage:
    """A whole output, split (None where a part is empty)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """Splits one choice's output. `max_calls` limits the tool calls kept (1 for
    parallel_tool_calls=false); `include_reasoning=False` drops the reasoning."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        prompt_token_ids: list[int],
        tool_parser: ToolParser | None,
        max_calls: int | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.max_calls = max_calls
        self.include_reasoning = include_reasoning
        self.in_reasoning = reasoning_parser is not None and not reasoning_parser.is_reasoning_end(
            prompt_token_ids
        )
        self._streamer = ToolCallStreamer(tool_parser, max_calls) if tool_parser else None
        self._reasoning_text = ""

    @property
    def active(self) -> bool:
        """Whether the output is split at all (otherwise it is content as generated)."""
        return self.in_reasoning or self.tool_parser is not None

    @property
    def tools_called(self) -> bool:
        """Whether a streamed output has sent a tool call."""
        return self._streamer is not None and self._streamer.tools_called

    # ---- a whole output ---------------------------------------------------------------------

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self.in_reasoning:
            reasoning, content = self.reasoning_parser.extract_reasoning_content(text)
        message = ParsedMessage(reasoning if self.include_reasoning else None, content)
        if self.tool_parser is not None and content:
            info = self.tool_parser.extract_tool_calls(content, max_calls=self.max_calls)
            if info.tools_called:
                message.content, message.tool_calls = info.content, info.tool_calls
        return message

    # ---- streamed ---------------------------------------------------------------------------

    def feed(self, delta_text: str, finished: bool = False) -> DeltaMessage | None:
        """What `delta_text` adds (with whatever was held back, when `finished`); None when
        there is nothing to send yet. Unsplit output passes through as content."""
        if not self.active:
            return DeltaMessage(content=delta_text)
        reasoning, content = None, delta_text
        if self.in_reasoning:
            previous = self._reasoning_text
            self._reasoning_text += delta_text
            delta = self.reasoning_parser.extract_reasoning_content_streaming(
                previous, self._reasoning_text, delta_text, (), (), ()
            )
            reasoning, content = delta if delta is not None else (None, None)
            if content is not None:
                self.in_reasoning = False
        tool_calls = []
        if self._streamer is not None:
            step = self._streamer.feed(content or "")
            if finished:
                tail = self._streamer.finish()
                step.content += tail.content
                step.tool_calls += tail.tool_calls
            content, tool_calls = step.content, step.tool_calls
        return self._delta(reasoning, content, tool_calls)

    def _delta(
        self, reasoning: str | None, content: str | None, tool_calls: list
    ) -> DeltaMessage | None:
        delta = DeltaMessage()
        if reasoning and self.include_reasoning:
            delta.reasoning_content = delta.reasoning = reasoning
        if content:
            delta.content = content
        if tool_calls:
            delta.tool_calls = tool_calls
        return delta if delta.model_fields_set else None
