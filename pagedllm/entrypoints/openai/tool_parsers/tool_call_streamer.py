"""`ToolCallStreamer`: one choice's streamed tool calls in OpenAI's delta shape.

Each delta re-reads the whole text with the parser's `parse` and sends what grew since last
time: new content; for a call whose name just became known, a first delta with `index`, `id`,
`type` and the name (arguments ""); then its argument fragments. The parser's contract (its
result only grows) makes the concatenated deltas equal `extract_tool_calls` on the whole
text. `finish` reads the text as final: held-back characters go out as content, and a text
that turned out not to be a call (while no call was sent) goes out as content too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


@dataclass
class ToolCallDelta:
    """What one step adds: content text and tool-call pieces (either may be empty)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolCallStreamer:
    """Turns growing text into content and tool-call deltas. `max_calls` (1 when the request
    sets parallel_tool_calls=false) drops the calls after the first ones."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def tools_called(self) -> bool:
        return bool(self._calls)

    def feed(self, delta_text: str) -> ToolCallDelta:
        self.text += delta_text
        return self._diff(final=False)

    def finish(self) -> ToolCallDelta:
        return self._diff(final=True)

    def _diff(self, final: bool) -> ToolCallDelta:
        parsed = self.parser.parse(self.text, final)
        if final and not parsed.valid and not self._calls:
            content = self.text[self._content_sent :]
            self._content_sent = len(self.text)
            return ToolCallDelta(content=content)
        out = ToolCallDelta(content=parsed.content[self._content_sent :])
        self._content_sent = max(self._content_sent, len(parsed.content))
        for index, call in enumerate(parsed.calls[: self.max_calls]):
            if index == len(self._calls):
                if call.name is None:
                    break  # later calls cannot be named before this one
                self._calls.append(_SentCall(self.parser.make_tool_call_id()))
                out.tool_calls.append(
                    DeltaToolCall(
                        index=index,
                        id=self._calls[index].id,
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            sent = self._calls[index]
            if len(call.arguments) > sent.arguments_sent:
                fragment = call.arguments[sent.arguments_sent :]
                sent.arguments_sent = len(call.arguments)
                out.tool_calls.append(
                    DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))
                )
        return out
