"""Nothing accepted then ignored: the request checks every endpoint runs before it starts.

The request models (protocol.py) list every field pagedllm honours, OpenAI's and vLLM's. Any
other field in a body is a 400 naming it: one OpenAI or vLLM defines that pagedllm cannot
honour (audio, predicted outputs, stored completions, multimodal or custom logits-processor
inputs, ...) unless it holds the value that describes what pagedllm does anyway (e.g.
`store: false`, `modalities: ["text"]`), and any field nobody defines. Fields that only
shape sampling are a 400 together with `use_beam_search` (the search does not sample), and
the cross-field rules OpenAI and vLLM apply are checked here too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.serving_engine import OpenAIError

# Fields of OpenAI's or vLLM's request schemas that pagedllm cannot honour, each with the
# values that ask for nothing more than what it does (None, or absent, is always fine).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "verbosity": (),
    "prompt_embeds": (),
    "mm_processor_kwargs": ({},),
    "logits_processors": ([],),
    "vllm_xargs": ({},),
    "kv_transfer_params": (),
}

# OpenAI's deprecated fields with the ones that replaced them (and that pagedllm takes).
_REPLACED = {"functions": "tools", "function_call": "tool_choice"}

# Request fields that only shape sampling: they have no meaning for a beam search.
_SAMPLING_ONLY = (
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "stop", "stop_token_ids", "min_tokens", "logit_bias", "allowed_token_ids",
    "bad_words", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip


def check_fields(request: BaseModel) -> None:
    """400 (OpenAIError naming the field) for a field pagedllm would not honour (module
    docstring); returns None when every field acts."""
    for name, value in (request.model_extra or {}).items():
        if name in _REPLACED:
            raise OpenAIError(
                f"{name} is deprecated by OpenAI and not supported by pagedllm: pass "
                f"{_REPLACED[name]} instead",
                param=name,
            )
        if name not in _UNSUPPORTED:
            raise OpenAIError(
                f"unknown field {name!r}: pagedllm accepts the OpenAI and vLLM request fields "
                "it honours, and no others",
                param=name,
            )
        if value is not None and value not in _UNSUPPORTED[name]:
            raise OpenAIError(
                f"{name}={value!r} is not supported by pagedllm"
                + (f" (only {list(_UNSUPPORTED[name])})" if _UNSUPPORTED[name] else ""),
                param=name,
            )
    for name in type(request).model_fields:
        value = getattr(request, name)
        if isinstance(value, BaseModel) and value.model_extra:
            unknown = next(iter(value.model_extra))
            raise OpenAIError(f"unknown field '{name}.{unknown}'", param=f"{name}.{unknown}")
    _check_cross_field_rules(request)
    if getattr(request, "use_beam_search", False):
        _check_beam_search(request)


def _check_cross_field_rules(request: Any) -> None:
    stream = bool(getattr(request, "stream", False))
    if getattr(request, "stream_options", None) is not None and not stream:
        raise OpenAIError("stream_options needs stream=true", param="stream_options")
    if getattr(request, "prompt_logprobs", None) is not None and stream:
        raise OpenAIError(
            "prompt_logprobs are not available with stream=true", param="prompt_logprobs"
        )
    if getattr(request, "top_logprobs", None) and not getattr(request, "logprobs", None):
        raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
    if getattr(request, "suffix", None):
        raise OpenAIError("suffix (insertion) is not supported by pagedllm", param="suffix")
    best_of, n = getattr(request, "best_of", None), getattr(request, "n", 1)
    if best_of is not None and not getattr(request, "use_beam_search", False) and best_of != n:
        raise OpenAIError(
            f"best_of={best_of} is only supported with use_beam_search=true (or equal to n={n})",
            param="best_of",
        )
    if best_of is not None and best_of < n:
        raise OpenAIError(f"best_of={best_of} must be >= n={n}", param="best_of")
    if getattr(request, "length_penalty", 1.0) != 1.0 and not getattr(
        request, "use_beam_search", False
    ):
        raise OpenAIError("length_penalty needs use_beam_search=true", param="length_penalty")
    if getattr(request, "max_tokens", None) == 0 and not getattr(request, "echo", False):
        raise OpenAIError("max_tokens=0 is only allowed with echo=true", param="max_tokens")


def _check_beam_search(request: Any) -> None:
    fields = type(request).model_fields
    for name in _SAMPLING_ONLY:
        if name not in request.model_fields_set or name not in fields:
            continue
        if getattr(request, name) != fields[name].get_default(call_default_factory=True):
            raise OpenAIError(
                f"{name} does not apply to beam search (use_beam_search=true)", param=name
            )
    if getattr(request, "echo", False) and getattr(request, "logprobs", None):
        raise OpenAIError(
            "echo with logprobs needs the prompt's logprobs, which beam search does not compute",
            param="echo",
        )
