"""What every OpenAI endpoint shares: model-name checks, prompt tokenization (on the
engine's tokenizer thread) and length limits, logprob formatting and merging several
generators.

Handlers raise `OpenAIError` (errors.py); the app turns it into `{"error": {message, type,
param, code}}` with the right HTTP status. Inside a stream that already started, the same body
is sent as a `data:` event instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from pagedllm.engine import EngineCoreRequest
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptTokenUsageInfo,
    UsageInfo,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide settings of the endpoints (vLLM's `serve` flags of the same names)."""

    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    response_role: str = "assistant"
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # --chat-template, loaded
    trust_request_chat_template: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    max_log_len: int | None = None
    enable_log_outputs: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServingOptions:
        """ValueError for a bad --chat-template or an --enable-log-outputs without
        --enable-log-requests."""
        from pagedllm.entrypoints.openai.cli_args import load_chat_template, log_requests_enabled

        log_outputs = bool(getattr(args, "enable_log_outputs", False))
        if log_outputs and not log_requests_enabled(args):
            raise ValueError("--enable-log-outputs needs --enable-log-requests")
        return cls(
            enable_prompt_tokens_details=bool(getattr(args, "enable_prompt_tokens_details", 0)),
            enable_force_include_usage=bool(getattr(args, "enable_force_include_usage", 0)),
            return_tokens_as_token_ids=bool(getattr(args, "return_tokens_as_token_ids", 0)),
            response_role=getattr(args, "response_role", None) or "assistant",
            # A JSON object (argparse's json_object_arg), or absent.
            default_chat_template_kwargs=getattr(args, "default_chat_template_kwargs", None) or {},
            chat_template=load_chat_template(getattr(args, "chat_template", None)),
            trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", 0)),
            exclude_tools_when_tool_choice_none=bool(
                getattr(args, "exclude_tools_when_tool_choice_none", 0)
            ),
            max_log_len=getattr(args, "max_log_len", None),
            enable_log_outputs=log_outputs,
        )


class OpenAIServing:
    """Base of the endpoint handlers; holds the engine, the names it is served under and the
    server's limits (default: resolved for the engine's model with the default flags).

    Tokenizing, rendering chat templates and processing requests are blocking: handlers run
    them through `in_tokenizer_thread`, never on the event loop."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        limits: ServerLimits | None = None,
        options: ServingOptions | None = None,
    ) -> None:
        self.engine = engine
        self.options = options or ServingOptions()
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = engine.model_config.max_model_len
        self.limits = (limits or ServerLimits()).for_model(self.tokenizer, self.max_model_len)
        # Defaults of unset request fields (max_tokens is resolved per request instead).
        self.default_sampling = engine.model_config.get_diff_sampling_param()

    def cached_tokens(self, num_cached_tokens: int) -> int | None:
        """What `make_usage` reports as the prompt's cached tokens: the count with
        --enable-prompt-tokens-details, else nothing (no `prompt_tokens_details`)."""
        return num_cached_tokens if self.options.enable_prompt_tokens_details else None

    def include_usage(self, request: Any) -> bool:
        """Whether a stream ends with a usage chunk: asked for, or --enable-force-include-usage."""
        return request.include_usage_in_stream or self.options.enable_force_include_usage

    def tokens_as_ids(self, request: Any) -> bool:
        """Logprob tokens as `token_id:N`: the request's field, else the server's default."""
        if request.return_tokens_as_token_ids is not None:
            return bool(request.return_tokens_as_token_ids)
        return self.options.return_tokens_as_token_ids

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_request(self, model: str | None) -> None:
        """404 for a model this server does not serve; 503 while the engine is dead."""
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(
                f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model"
            )
        if self.engine.errored:
            raise OpenAIError(str(self.engine.dead_error), HTTPStatus.SERVICE_UNAVAILABLE)

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine's tokenizer thread (one thread: calls are serialized)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.engine.tokenizer_executor, fn, *args)

    def tokenize_text(
        self, text: str, add_special_tokens: bool, field: str = "prompt"
    ) -> list[int]:
        """Blocking. 400 for an empty text or one over `--max-prompt-chars`."""
        if not isinstance(text, str) or text == "":
            raise OpenAIError(f"{field} must be a non-empty string", param=field)
        self.limits.check_prompt_chars(text, field)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, what: str) -> int:
        """The output budget: `requested`, or what is left of max_model_len. 400 when the
        prompt (plus `requested`) does not fit, naming the limit."""
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt_len} input tokens. Please reduce the length of the "
                f"{what}.",
                param="messages" if what == "messages" else "prompt",
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if isinstance(requested, int) and requested >= 1:
            if prompt_len + requested > self.max_model_len:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {prompt_len + requested} tokens ({prompt_len} in "
                    f"the {what}, {requested} in the completion). Please reduce the length of "
                    f"the {what} or completion.",
                    param="max_tokens",
                )
        return requested  # SamplingParams rejects values < 1 with a field-naming message

    def engine_prompt(self, text: str | None, ids: list[int], request: Any) -> dict[str, Any]:
        """The engine's prompt dict: token ids (the last `truncate_prompt_tokens` of them when
        set, vLLM's left truncation), the text, and the request's `cache_salt` and
        `prompt_cache_key`."""
        limit = getattr(request, "truncate_prompt_tokens", None)
        if limit is not None and len(ids) > limit:
            ids, text = ids[-limit:], None
        prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
        if getattr(request, "cache_salt", None) is not None:
            prompt["cache_salt"] = request.cache_salt
        if getattr(request, "prompt_cache_key", None) is not None:
            prompt["prompt_cache_key"] = request.prompt_cache_key
        return prompt

    def validate(
        self, request_id: str, prompt: dict[str, Any], request: Any, max_tokens: int
    ) -> tuple[Any, tuple[str | None, EngineCoreRequest]]:
        """Blocking (the tokenizer thread): the request's sampling or beam-search params and
        the engine's processed input, or a 400 naming what is wrong."""
        self.limits.check_n(request.n)
        try:
            if getattr(request, "use_beam_search", False):
                params: Any = request.to_beam_search_params(max_tokens, self.default_sampling)
            else:
                params = request.to_sampling_params(max_tokens, self.default_sampling)
            processed = self.engine.processor.process_inputs(
                request_id, prompt, params, None, request.priority
            )
        except ValueError as e:  # a ParamValueError names its field
            raise OpenAIError(str(e), param=request.request_param(getattr(e, "param", None))) from e
        return params, processed

    async def generate(
        self,
        request_id: str,
        prompt: dict[str, Any],
        request: Any,
        max_tokens: int,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate now, on the tokenizer thread (bad input is a 400 before a stream starts),
        and return the engine's output stream: sampling, or with `use_beam_search` a beam
        search whose best `n` beams are the choices. `data_parallel_rank`: the engine to run
        it on (vLLM's X-data-parallel-rank header), else the load balancer's pick."""
        params, processed = await self.in_tokenizer_thread(
            self.validate, request_id, prompt, request, max_tokens
        )
        if data_parallel_rank is not None:
            engines = self.engine.config.parallel_config.data_parallel_size
            if not 0 <= data_parallel_rank < engines:
                raise OpenAIError(
                    f"X-data-parallel-rank={data_parallel_rank} is out of range: there are "
                    f"{engines} data-parallel engines",
                    param="X-data-parallel-rank",
                )
            processed[1].data_parallel_rank = data_parallel_rank
        if self.engine.log_requests:
            logger.info(
                "Received request %s: prompt_tokens=%d, user=%s, params=%s",
                request_id,
                len(prompt["prompt_token_ids"]),
                getattr(request, "user", None) or getattr(request, "safety_identifier", None),
                params,
            )
            if logger.isEnabledFor(logging.DEBUG):  # vLLM's: the prompt itself only at DEBUG
                limit = self.options.max_log_len
                logger.debug(
                    "Request %s details: prompt: %r, prompt_token_ids: %s",
                    request_id,
                    _clipped(prompt.get("prompt"), limit),
                    _clipped(prompt["prompt_token_ids"], limit),
                )
        outputs = self.engine.generate(
            prompt, params, request_id, priority=request.priority, processed=processed
        )
        if isinstance(params, BeamSearchParams):
            outputs = _best_beams(outputs, request.n)
        if self.options.enable_log_outputs:
            delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
            outputs = _logged_outputs(request_id, outputs, delta, self.options.max_log_len)
        return outputs

    # ------------------------------------------------------------------------- logprobs

    def token_text(self, token_id: int, logprob: Logprob | None = None, as_id: bool = False) -> str:
        """A token as logprobs show it: its text, or `token_id:<id>` with vLLM's
        `return_tokens_as_token_ids` (for tokens that are not valid UTF-8 on their own)."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def completion_logprobs(
        self,
        token_ids: list[int],
        step_logprobs: list[dict[int, Logprob] | None],
        num_top: int,
        initial_text_offset: int = 0,
        as_ids: bool = False,
    ) -> CompletionLogProbs:
        """The legacy completions format: per token its text, logprob, text offset, and a
        {text: logprob} map of the token and its `num_top` best alternatives (null for a
        position without logprobs, as OpenAI reports the first prompt token)."""
        tokens: list[str] = []
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offset = initial_text_offset
        for i, token_id in enumerate(token_ids):
            step = step_logprobs[i] if i < len(step_logprobs) else None
            chosen = step.get(token_id) if step else None
            text = self.token_text(token_id, chosen, as_ids)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if step is None or chosen is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(max(chosen.logprob, -9999.0))
            best = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            top = {self.token_text(token_id, chosen, as_ids): max(chosen.logprob, -9999.0)}
            top.update((self.token_text(t, lp, as_ids), max(lp.logprob, -9999.0)) for t, lp in best)
            top_logprobs.append(top)
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=top_logprobs,
        )

    def chat_logprobs(
        self,
        token_ids: list[int],
        step_logprobs: list[dict[int, Logprob]] | None,
        top: int,
        as_ids: bool = False,
    ) -> ChatCompletionLogProbs:
        content: list[ChatCompletionLogProbsContent] = []
        for i, token_id in enumerate(token_ids):
            step = step_logprobs[i] if step_logprobs and i < len(step_logprobs) else {}
            sampled = step.get(token_id)
            text = self.token_text(token_id, sampled, as_ids)
            alternatives = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:top]
            content.append(
                ChatCompletionLogProbsContent(
                    token=text,
                    logprob=max(sampled.logprob, -9999.0) if sampled else -9999.0,
                    bytes=list(text.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=(t := self.token_text(tid, lp, as_ids)),
                            logprob=max(lp.logprob, -9999.0),
                            bytes=list(t.encode("utf-8", errors="replace")),
                        )
                        for tid, lp in alternatives
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)


async def merge_async_iterators(
    *iterators: AsyncGenerator[Any, None],
) -> AsyncIterator[tuple[int, Any]]:
    """Yield `(i, item)` from several async generators as items arrive. Closing this
    generator (or cancelling its consumer) cancels and closes all of them."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[i].__anext__())] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def final_output(generator: AsyncGenerator[Any, None]) -> Any:
    """The last output of a non-streamed request's generator (errors as OpenAIError)."""
    final = None
    try:
        async for res in generator:
            final = res
    except Exception as e:
        raise OpenAIError.from_exception(e) from e
    assert final is not None
    return final


def _clipped(seq: Any, limit: int | None) -> Any:
    """`seq` cut to its first `limit` items (characters or token ids), as --max-log-len asks."""
    return seq if seq is None or limit is None else seq[:limit]


async def _logged_outputs(
    request_id: str,
    outputs: AsyncGenerator[RequestOutput, None],
    delta: bool,
    limit: int | None,
) -> AsyncGenerator[RequestOutput, None]:
    """`outputs` unchanged; once finished, each choice's text (INFO) and token ids (DEBUG)
    logged, cut to --max-log-len (--enable-log-outputs)."""
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    try:
        async for out in outputs:
            for c in out.outputs:
                if delta:
                    texts.setdefault(c.index, []).append(c.text)
                    ids.setdefault(c.index, []).extend(c.token_ids)
                else:
                    texts[c.index], ids[c.index] = [c.text], c.token_ids
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
            if out.finished:
                for index in sorted(texts):
                    text = "".join(texts[index])
                    logger.info(
                        "Generated response %s (choice %d): output: %r, finish_reason: %s",
                        request_id, index, _clipped(text, limit), reasons.get(index),
                    )  # fmt: skip
                    logger.debug(
                        "Generated response %s (choice %d) details: output_token_ids: %s",
                        request_id, index, _clipped(list(ids[index]), limit),
                    )  # fmt: skip
            yield out
    finally:
        await outputs.aclose()


async def _best_beams(
    outputs: AsyncGenerator[RequestOutput, None], n: int
) -> AsyncGenerator[RequestOutput, None]:
    """A beam search's outputs with only its `n` best beams (beam_width may be larger)."""
    try:
        async for out in outputs:
            out.outputs = out.outputs[:n]
            yield out
    finally:
        await outputs.aclose()


def make_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> UsageInfo:
    """OpenAI's usage block; `prompt_tokens_details` when `cached_tokens` is given."""
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    if cached_tokens is not None:
        usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
    return usage
