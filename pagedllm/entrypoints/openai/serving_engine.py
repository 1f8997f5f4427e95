"""What every OpenAI endpoint shares: model-name checks, prompt tokenization and length
limits, OpenAI-shaped errors, logprob formatting and merging several generators.

Handlers raise `OpenAIError`; the app turns it into `{"error": {message, type, param, code}}`
with the right HTTP status. Inside a stream that already started, the same body is sent as a
`data:` event instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.CONFLICT: "ConflictError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape with HTTP status `status_code`."""

    def __init__(
        self,
        message: str,
        status_code: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(HTTPStatus(self.status_code), "Error")

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.err_type, param=self.param, code=self.status_code
            )
        )

    @classmethod
    def from_exception(cls, e: BaseException) -> OpenAIError:
        """ValueError -> 400, dead engine -> 503, anything else -> 500."""
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, ValueError):
            return cls(str(e), HTTPStatus.BAD_REQUEST)
        if isinstance(e, EngineDeadError):
            return cls(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
        return cls(f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)


class OpenAIServing:
    """Base of the endpoint handlers; holds the engine and the names it is served under."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = engine.model_config.max_model_len
        # Defaults of unset request fields (max_tokens is resolved per request instead).
        self.default_sampling = engine.model_config.get_diff_sampling_param()

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

    def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if not isinstance(text, str) or text == "":
            raise OpenAIError("prompt must be a non-empty string", param="prompt")
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
        set, vLLM's left truncation), the text, and the request's `cache_salt`."""
        limit = getattr(request, "truncate_prompt_tokens", None)
        if limit is not None and len(ids) > limit:
            ids, text = ids[-limit:], None
        prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
        if getattr(request, "cache_salt", None) is not None:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    def generate(
        self, request_id: str, prompt: dict[str, Any], request: Any, max_tokens: int
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate now (bad input is a 400 before a stream starts) and return the engine's
        output stream: sampling, or with `use_beam_search` a beam search whose best `n`
        beams are the choices."""
        try:
            if getattr(request, "use_beam_search", False):
                params: Any = request.to_beam_search_params(max_tokens, self.default_sampling)
            else:
                params = request.to_sampling_params(max_tokens, self.default_sampling)
            processed = self.engine.processor.process_inputs(
                request_id, prompt, params, None, request.priority
            )
        except ValueError as e:
            raise OpenAIError(str(e)) from e
        if self.engine.log_requests:
            logger.info(
                "Received request %s: prompt_tokens=%d, user=%s, params=%s",
                request_id,
                len(prompt["prompt_token_ids"]),
                getattr(request, "user", None) or getattr(request, "safety_identifier", None),
                params,
            )
        outputs = self.engine.generate(
            prompt, params, request_id, priority=request.priority, processed=processed
        )
        if isinstance(params, BeamSearchParams):
            return _best_beams(outputs, request.n)
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


def make_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """OpenAI's usage block."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
