"""Mistral (`--tool-call-parser mistral`): content, then `[TOOL_CALLS]` and either a JSON array

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

(tokenizers before v11) or, from v11 on, one `[TOOL_CALLS]name[ARGS]{...}` per call. Tool-call
ids are Mistral's: 9 letters and digits.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolCalls,
    ToolParser,
    split_at_marker,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import (
    scan_call_array,
    scan_value,
    skip_ws,
)

_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` followed by a call array, or by `name[ARGS]{...}` calls."""

    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"

    def adjust_request(self, request: Any) -> Any:
        request.skip_special_tokens = False  # [TOOL_CALLS] is a special token
        return request

    def make_tool_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        result, at = split_at_marker(text, self.bot_token, final)
        if at < 0:
            return result
        pos = skip_ws(text, at + len(self.bot_token))
        if text.startswith("[", pos):
            result.calls, result.valid = scan_call_array(text, pos, ("arguments",))
        else:
            self._parse_named_calls(text, at, result)
        if final and (not result.calls or not result.calls[-1].complete):
            result.valid = False
        return result

    def _parse_named_calls(self, text: str, at: int, result: ParsedToolCalls) -> None:
        """v11+: `[TOOL_CALLS]name[ARGS]{...}`, repeated."""
        while at >= 0:
            start = at + len(self.bot_token)
            args_at = text.find(self.args_token, start)
            if args_at < 0:
                result.calls.append(ParsedCall())
                return
            call = ParsedCall(name=text[start:args_at].strip())
            pos = skip_ws(text, args_at + len(self.args_token))
            end = scan_value(text, pos) if pos < len(text) else None
            call.arguments = text[pos:end] if end is not None else text[pos:]
            call.complete = end is not None
            result.calls.append(call)
            if end is None:
                return
            at = text.find(self.bot_token, end)
