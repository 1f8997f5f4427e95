"""`tool_choice` of the chat API: which calls a request allows, the output constraint that
guarantees them, and the parser that reads them back.

- `"none"`: tools are still rendered into the prompt (the template decides how); the output
  is plain content.
- `"auto"` (the default when `tools` are given): the model decides; the server's
  `--tool-call-parser` reads its calls, which needs `--enable-auto-tool-choice` (a 400 naming
  both flags otherwise, as in vLLM).
- `"required"` and a named function: the output is constrained with structured outputs to
  JSON made from the functions' parameter schemas (vLLM's shapes), so even a weak model
  returns a parseable call: for a named function, its arguments object; for "required", an
  array of `{"name": ..., "parameters": ...}` objects, one of the tools each (at most one
  with `parallel_tool_calls=false`). These need no flags.
"""

from __future__ import annotations

import copy
from typing import Any

from pagedllm.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolCalls,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import (
    scan_call_array,
    scan_value,
    skip_ws,
)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
AUTO_TOOL_CHOICE_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


def effective_tool_choice(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: str | ChatCompletionNamedToolChoiceParam | None,
) -> str | ChatCompletionNamedToolChoiceParam:
    """The request's tool choice with OpenAI's default filled in ("auto" with tools, "none"
    without). ValueError (naming the field) for a choice the tools cannot satisfy."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice != "none" and not tools:
        raise ValueError(f"tool_choice={_describe(tool_choice)} needs `tools` to be set")
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        names = [t.function.name for t in tools or []]
        if tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {tool_choice.function.name!r}, which is not "
                f"in tools ({names})"
            )
    return tool_choice


def _describe(tool_choice: Any) -> str:
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        return f"{{function: {tool_choice.function.name!r}}}"
    return repr(tool_choice)


def tool_choice_json_schema(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: str | ChatCompletionNamedToolChoiceParam,
    parallel_tool_calls: bool = True,
) -> dict[str, Any] | None:
    """The JSON schema the output must follow for a "required" or named tool choice; None for
    "auto" and "none". Parameter schemas' `$defs` move to the top (references stay valid)."""
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        tool = next(t for t in tools or [] if t.function.name == tool_choice.function.name)
        return copy.deepcopy(tool.function.parameters or _EMPTY_PARAMETERS)
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools or []:
        parameters = copy.deepcopy(tool.function.parameters or _EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(
                    f"tools define '$defs/{name}' differently; tool_choice='required' needs "
                    "one definition per name"
                )
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolCallParser(ToolParser):
    """Reads the output of a named tool choice: the whole text is the call's arguments."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        pos = skip_ws(text, 0)
        end = scan_value(text, pos) if pos < len(text) else None
        arguments = text[pos:end] if end is not None else text[pos:]
        return ParsedToolCalls(calls=[ParsedCall(self.name, arguments, end is not None)])


class RequiredToolCallsParser(ToolParser):
    """Reads the output of tool_choice="required": `[{"name": ..., "parameters": ...}, ...]`."""

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        calls, valid = scan_call_array(text, skip_ws(text, 0), ("parameters",))
        return ParsedToolCalls(calls=calls, valid=valid)


def select_tool_parser(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: str | ChatCompletionNamedToolChoiceParam | None,
    tokenizer: Any,
    auto_tool_parser: ToolParser | None,
) -> ToolParser | None:
    """The parser that reads this request's tool calls (None: the output is plain content).
    ValueError for "auto" on a server started without the auto-tool-choice flags."""
    choice = effective_tool_choice(tools, tool_choice)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolCallParser(tokenizer, choice.function.name)
    if choice == "required":
        return RequiredToolCallsParser(tokenizer)
    if choice == "auto":
        if auto_tool_parser is None:
            raise ValueError(f'"auto" tool choice requires {AUTO_TOOL_CHOICE_FLAGS} to be set')
        return auto_tool_parser
    return None
