"""Chat messages -> prompt text through the tokenizer's chat template, shared by the offline
`LLM.chat` and the OpenAI server's chat endpoints, so both render a conversation the same way.

Messages are OpenAI-shaped dicts: `content` is a string or a list of text parts (joined by
newlines; other part types are refused), an assistant's `tool_calls` carry their arguments as
JSON text (templates get them as objects, as vLLM passes them). Every problem is a ValueError
whose text names what is wrong; the server turns it into a 400."""

from __future__ import annotations

import json
from typing import Any


def flatten_content(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"message content part of type {kind!r} is not supported (text only)"
                )
        return "\n".join(texts)
    raise ValueError(f"message content must be a string or a list, got {content!r}")


def history_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A history message as chat templates expect it: an assistant's `tool_calls` carry their
    arguments as objects, not the JSON text the API sends (as vLLM passes them)."""
    calls = message.get("tool_calls")
    if not calls or not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # left as text; the template decides what to do with it
            call = {**call, "function": {**function, "arguments": arguments}}
        converted.append(call)
    return {**message, "tool_calls": converted}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """The prompt text of one conversation (not tokenized: the caller tokenizes it without
    adding special tokens again, as `apply_chat_template(tokenize=True)` does)."""
    if not messages:
        raise ValueError("messages must be a non-empty list")
    conversation = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"every message needs a string 'role', got {str(m)[:80]!r}")
        conversation.append(
            history_for_template({**m, "content": flatten_content(m.get("content"))})
        )
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools or None,
            documents=documents,
            **(chat_template_kwargs or {}),
        )
    except ValueError as e:
        raise ValueError(f"cannot apply the chat template: {e}") from e
    except Exception as e:  # jinja2 errors from a user-supplied template
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
