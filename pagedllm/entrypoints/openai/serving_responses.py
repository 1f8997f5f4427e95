"""`POST /v1/responses`: the Responses API, text in and out, on top of the chat path.

A request becomes a chat request (protocol_responses.py) and runs through
`OpenAIServingChat.start_chat`, so the chat template, tool calling and reasoning parsers apply
the same way. Its output becomes Responses output items: a `reasoning` item (with a reasoning
parser), a `message` item with one `output_text` part, and a `function_call` item per tool
call. A response cut by `max_output_tokens` is `incomplete`.

A stream sends OpenAI's events (`event: TYPE` + `data: JSON`, numbered by `sequence_number`):
`response.created`, `response.in_progress`, then per item `response.output_item.added`, its
content part and deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and
`response.output_item.done`, and finally `response.completed` (or `response.incomplete`)
with the whole response. Nothing is stored: `previous_response_id` and `store` are a 400.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from pagedllm.entrypoints.openai.chat_output import ChatOutputParser
from pagedllm.entrypoints.openai.protocol import DeltaMessage, random_uuid
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, final_output
from pagedllm.outputs import RequestOutput


class OpenAIServingResponses:
    """Responses handler over a chat handler (and the server's chat template).
    `create_response` returns the response object (a dict in OpenAI's shape) or, for
    `stream=true`, an async generator of SSE strings."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(
        self,
        request: ResponsesRequest,
        request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> dict[str, Any] | AsyncGenerator[str, None]:
        self.chat.check_request(request.model)
        try:
            chat_request = request.to_chat_request()
        except ValueError as e:
            raise OpenAIError(str(e)) from e
        response_id = f"resp_{request.request_id or request_id or random_uuid()}"
        generator, prompt_ids, parsers = await self.chat.start_chat(
            chat_request, response_id, data_parallel_rank
        )
        base = _base_response(request, response_id, self.chat.model_name)
        if request.stream:
            return _ResponseStream(self, base, generator, parsers[0], len(prompt_ids)).events()
        final: RequestOutput = await final_output(generator)
        out = final.outputs[0]
        parsed = parsers[0].parse(out.text)
        items = []
        if parsed.reasoning:
            items.append(_reasoning_item(parsed.reasoning, "completed"))
        if parsed.content:
            items.append(_message_item(parsed.content, "completed"))
        for call in parsed.tool_calls:
            items.append(_function_call_item(call.id, call.function.name, call.function.arguments))
        usage = self.usage(len(prompt_ids), len(out.token_ids), parsed.reasoning, final)
        return _finished(base, items, out.finish_reason, usage)

    def usage(
        self, num_prompt: int, num_output: int, reasoning: str | None, final: RequestOutput
    ) -> dict[str, Any]:
        reasoning_tokens = 0
        if reasoning:  # the reasoning text's length in tokens
            reasoning_tokens = len(
                self.chat.tokenizer(reasoning, add_special_tokens=False).input_ids
            )
        return {
            "input_tokens": num_prompt,
            "input_tokens_details": {
                "cached_tokens": final.num_cached_tokens or 0,
                "cache_write_tokens": 0,
            },
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, num_output)},
            "total_tokens": num_prompt + num_output,
        }


def _base_response(request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    tool_choice = request.tool_choice if request.tool_choice is not None else "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
        "text": request.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "previous_response_id": None,
        "reasoning": request.reasoning,
        "user": request.user,
        "usage": None,
    }


def _finished(
    base: dict[str, Any], items: list[dict], finish_reason: str | None, usage: dict
) -> dict[str, Any]:
    incomplete = finish_reason == "length"
    return {
        **base,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": items,
        "usage": usage,
    }


def _reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or f"rs_{random_uuid()}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
        "status": status,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or f"msg_{random_uuid()}",
        "role": "assistant",
        "status": status,
        "content": [_output_text(text)] if text else [],
    }


def _function_call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or f"fc_{random_uuid()}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class _ResponseStream:
    """The event stream of one response: opens an output item when its first delta arrives,
    closes it (its .done events) when another kind of delta or the end comes."""

    def __init__(
        self,
        handler: OpenAIServingResponses,
        base: dict[str, Any],
        generator: AsyncGenerator[RequestOutput, None],
        parser: ChatOutputParser,
        num_prompt_tokens: int,
    ) -> None:
        self.handler = handler
        self.base = base
        self.generator = generator
        self.parser = parser
        self.num_prompt_tokens = num_prompt_tokens
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncGenerator[str, None]:
        yield self.event("response.created", response=self.base)
        yield self.event("response.in_progress", response=self.base)
        final: RequestOutput | None = None
        num_output = 0
        try:
            async for res in self.generator:
                final, out = res, res.outputs[0]
                num_output += len(out.token_ids)
                delta = self.parser.feed(out.text, out.finish_reason is not None)
                if delta is not None:
                    for text in self.on_delta(delta):
                        yield text
            for text in self.close():
                yield text
            assert final is not None
            usage = self.handler.usage(self.num_prompt_tokens, num_output, self.reasoning, final)
            response = _finished(self.base, self.items, final.outputs[0].finish_reason, usage)
            kind = f"response.{response['status']}"
            yield self.event(kind, response=response)
        except Exception as e:
            error = OpenAIError.from_exception(e)
            yield self.event(
                "error", code=str(error.status_code), message=error.message, param=error.param
            )
        finally:
            await self.generator.aclose()

    def on_delta(self, delta: DeltaMessage):
        if delta.reasoning:
            self.reasoning += delta.reasoning
            yield from self.text_delta("reasoning", delta.reasoning)
        if delta.content:
            yield from self.text_delta("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its name, with empty arguments
                yield from self.close()
                item = _function_call_item(call.id, call.function.name, "", "in_progress")
                yield from self.open_item(item)
            elif call.function and call.function.arguments:
                self.open["arguments"] += call.function.arguments
                yield self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items),
                    delta=call.function.arguments,
                )

    def open_item(self, item: dict[str, Any]):
        self.open = item
        yield self.event("response.output_item.added", output_index=len(self.items), item=item)

    def text_delta(self, kind: str, text: str):
        """A reasoning or message text delta, opening its item and part first if needed."""
        if self.open is None or self.open["type"] != kind:
            yield from self.close()
            if kind == "reasoning":
                item, part = (
                    _reasoning_item("", "in_progress"),
                    {"type": "reasoning_text", "text": ""},
                )
            else:
                item, part = _message_item("", "in_progress"), _output_text("")
            yield from self.open_item(item)
            item["content"].append(part)
            yield self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.items),
                content_index=0,
                part=part,
            )
        self.open["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield self.event(
            f"response.{name}.delta",
            item_id=self.open["id"],
            output_index=len(self.items),
            content_index=0,
            delta=text,
            **extra,
        )

    def close(self):
        """The .done events of the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items)
        if item["type"] == "function_call":
            yield self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
        else:
            part = item["content"][0]
            name = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            yield self.event(
                f"response.{name}.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                **extra,
            )
            yield self.event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        item["status"] = "completed"
        self.items.append(item)
        yield self.event("response.output_item.done", output_index=index, item=item)
