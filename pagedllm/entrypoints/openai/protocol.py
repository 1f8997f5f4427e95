"""Pydantic models of the OpenAI-compatible API: OpenAI's request and response shapes, plus
vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, ...).

Requests accept unknown fields (OpenAI clients send new ones all the time) and check types;
range checks live in `SamplingParams`, so the HTTP API and `LLM` reject the same values with
the same messages.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol_tools import (
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
    ToolChoice,
)
from pagedllm.entrypoints.openai.structured_outputs import StructuredOutputsRequestMixin
from pagedllm.entrypoints.openai.tool_choice import effective_tool_choice, tool_choice_json_schema
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams

# OpenAI's reasoning efforts, plus vLLM's "max" (DeepSeek V4's templates).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_view: bool = True
    organization: str = "*"
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    # With --enable-prompt-tokens-details: the prompt tokens served from the prefix cache.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingRequestMixin(OpenAIBaseModel, StructuredOutputsRequestMixin):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras; the
    structured-output fields come from `StructuredOutputsRequestMixin`)."""

    # SamplingParams fields whose request field has another name (`request_param`).
    _param_names: ClassVar[dict[str, str]] = {}

    def request_param(self, sampling_param: str | None) -> str | None:
        """The request field a bad SamplingParams field (a `ParamValueError`'s) came from."""
        if sampling_param is None:
            return None
        return self._param_names.get(sampling_param, sampling_param)

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    # End-user identifiers: logged with the request (--enable-log-requests).
    user: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    # OpenAI's: requests that share a long prefix share a key; with data parallelism they stay
    # on one engine (engine/load_balancer.py), with one engine its prefix cache serves them all.
    prompt_cache_key: str | None = None

    def to_beam_search_params(self, max_tokens: int, defaults: dict[str, Any]) -> BeamSearchParams:
        """vLLM's mapping: beam_width is best_of (or n); the n best beams are returned."""
        temperature = self.temperature
        if temperature is None:
            temperature = defaults.get("temperature", 1.0)
        return BeamSearchParams(
            beam_width=self.best_of or self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    # Disaggregated prefill/decode (vLLM's field): what the engine's KV connector should do
    # with this request's KV, e.g. pull it from a prefill instance.
    kv_transfer_params: dict[str, Any] | None = None

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any],
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Unset fields fall back to `defaults` (the model's generation_config), then to
        OpenAI's defaults. Raises ValueError for out-of-range values."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.to_structured_outputs(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            extra_args=(
                {"kv_transfer_params": self.kv_transfer_params}
                if self.kv_transfer_params is not None
                else None
            ),
        )

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(
            self.stream_options
            and self.stream_options.include_usage
            and self.stream_options.continuous_usage_stats
        )


# ----------------------------------------------------------------------------- completions


class CompletionRequest(SamplingRequestMixin):
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens=0`: return the prompt (and its logprobs), generate
        nothing (how evaluation harnesses score a text)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, defaults, prompt_logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)


# ------------------------------------------------------------------------------------ chat


class ChatCompletionRequest(SamplingRequestMixin):
    _param_names: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = Field(default=None, description="Deprecated by OpenAI.")
    max_completion_tokens: int | None = None
    # vLLM's chat extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools (see tool_choice.py) and reasoning output.
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    reasoning_effort: ReasoningEffort | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The request's chat_template_kwargs with its `reasoning_effort`, as vLLM passes it:
        the effort itself, and `enable_thinking` off for "none" and on for any other effort
        (what Qwen3-style templates read); the request's own kwargs win."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        effort = {
            "reasoning_effort": self.reasoning_effort,
            "enable_thinking": self.reasoning_effort != "none",
        }
        return {**effort, **(self.chat_template_kwargs or {})}

    def to_structured_outputs(
        self, implied: dict[str, dict[str, Any]] | None = None
    ) -> StructuredOutputsParams | None:
        """A "required" or named tool choice constrains the output to a JSON schema, compact
        (a weak model cannot wander off into whitespace)."""
        choice = effective_tool_choice(self.tools, self.tool_choice)
        schema = tool_choice_json_schema(self.tools, choice, self.parallel_tool_calls is not False)
        implied = dict(implied or {})
        if schema is not None:
            implied["tool_choice"] = {"json": schema, "disable_any_whitespace": True}
        return super().to_structured_outputs(implied)

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        num_logprobs = None
        if self.logprobs:
            num_logprobs = self.top_logprobs or 0
        prompt_logprobs = self.prompt_logprobs
        if self.echo and prompt_logprobs is None:  # vLLM: echo reports the prompt's logprobs
            prompt_logprobs = self.top_logprobs or 0
        return self._sampling_params(max_tokens, num_logprobs, defaults, prompt_logprobs)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name of reasoning_content
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)


# ---------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
