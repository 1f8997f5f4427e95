"""Processor: validates a user request and turns it into an `EngineCoreRequest`.

Everything that can be wrong with a request is found here, before anything is scheduled, and
raised as a `ValueError` that names the field and the value.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched.beam import check_beam_search_fits
from pagedllm.engine import EngineCoreRequest
from pagedllm.sampling_params import (
    BeamSearchParams,
    ParamValueError,
    RequestOutputKind,
    SamplingParams,
)
from pagedllm.spec_decode.config import get_speculative_config
from pagedllm.structured_output.backend_xgrammar import StructuredOutputValidator

# vLLM's prompt forms: a string, {"prompt": str}, or {"prompt_token_ids": [...]}; a dict may
# carry a "cache_salt" (its prefix-cache namespace) and a "prompt_cache_key" (which keeps
# requests that share it on one data-parallel engine, whose prefix cache then serves them).
PromptType = str | dict[str, Any]


class Processor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.validate_structured_outputs = StructuredOutputValidator()

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError(
                    f"prompt_token_ids must be a list of integers, got {str(ids)[:100]!r}"
                )
            return prompt.get("prompt"), list(ids)
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
        else:
            raise ValueError(
                "prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}: {str(prompt)[:100]!r}"
            )
        if text == "":
            raise ValueError("prompt must not be empty, got ''")
        return text, self.tokenizer.encode(text)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize. With `BeamSearchParams` the engine core runs a beam search
        and answers once, with every beam (`EngineCoreRequest.beam_search`)."""
        beam_search = None
        if isinstance(params, BeamSearchParams):
            beam_search, params = params, self._beam_search_sampling_params(params)
        elif not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(
                f"priority={priority} needs scheduling_policy='priority' (it is "
                f"{self.config.scheduler_config.policy!r})"
            )
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        cache_key = prompt.get("prompt_cache_key") if isinstance(prompt, dict) else None
        if cache_key is not None and not isinstance(cache_key, str):
            raise ValueError(f"prompt_cache_key must be a string, got {cache_key!r}")
        self._validate_prompt(prompt_ids)
        params = self._validate_params(params, len(prompt_ids))
        if beam_search is not None:
            self._validate_beam_search(beam_search, len(prompt_ids))
        eos = self.model_config.eos_token_ids
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            eos_token_id=eos[0] if eos else None,
            beam_search=beam_search,
            cache_salt=cache_salt,
            prompt_cache_key=cache_key,
        )
        return prompt_text, request

    @staticmethod
    def _beam_search_sampling_params(params: BeamSearchParams) -> SamplingParams:
        """What the front end needs of a beam search (detokenization): one final output."""
        return SamplingParams(
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _validate_beam_search(self, params: BeamSearchParams, prompt_len: int) -> None:
        if get_speculative_config(self.config) is not None:
            raise ValueError("beam search is not supported together with speculative decoding")
        if params.num_candidates > self.vocab_size:
            raise ValueError(
                f"beam_width={params.beam_width} needs {params.num_candidates} candidates per "
                f"step, more than the vocabulary ({self.vocab_size})"
            )
        sched, cache = self.config.scheduler_config, self.config.cache_config
        check_beam_search_fits(
            params,
            prompt_len,
            self.max_model_len,
            sched.max_num_seqs,
            cache.block_size,
            cache.num_blocks,
        )

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: it must be shorter, to leave room for at least one "
                "output token"
            )
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"prompt token id {bad} is out of the vocabulary (0..{self.vocab_size - 1})"
            )

    def _validate_kv_transfer_params(self, params: SamplingParams) -> None:
        """`kv_transfer_params` (in `extra_args`) need a KV connector that takes them."""
        extra = params.extra_args
        if not extra or extra.get("kv_transfer_params") is None:
            return
        if not isinstance(extra["kv_transfer_params"], dict):
            raise ValueError(
                f"kv_transfer_params must be a JSON object, got {extra['kv_transfer_params']!r}"
            )
        kv_config = self.config.kv_transfer_config
        if kv_config is None:
            raise ValueError(
                "kv_transfer_params were given but this engine has no KV connector; start it "
                "with kv_transfer_config (--kv-transfer-config)"
            )
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        connector_class = KVConnectorFactory.get_connector_class(kv_config)
        connector_class.validate_kv_transfer_params(params, kv_config)

    def _validate_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        limit = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and limit >= 0 and value > limit:
                raise ParamValueError(
                    f"{name}={value} is more than the maximum ({limit}; the server's "
                    "--max-logprobs)",
                    name,
                )
        for name in ("allowed_token_ids", "stop_token_ids", "logit_bias"):
            ids = getattr(params, name) or []  # logit_bias: its keys
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ParamValueError(
                    f"{name} has token ids out of the vocabulary: {bad[:10]}", name
                )
        self.validate_structured_outputs(params)  # bad schema/regex/grammar: compiler's message
        self._validate_kv_transfer_params(params)
        params = params.clone()
        so = params.structured_outputs
        if so is not None and self.config.structured_outputs_config.disable_any_whitespace:
            so.disable_any_whitespace = True  # (the server's setting; a clone of the request's)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - prompt_len
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        params.update_from_generation_config(
            self.model_config.generation_config, self.model_config.eos_token_ids
        )
        return params
