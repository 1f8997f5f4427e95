"""Sampling parameters for text generation, with vLLM's field names and defaults."""

from __future__ import annotations

import copy
import math
from enum import IntEnum
from typing import Any

import msgspec

from pagedllm.structured_output.params import (
    GuidedDecodingParams,
    StructuredOutputsParams,
    as_structured_outputs_params,
)

_SAMPLING_EPS = 1e-5


class ParamValueError(ValueError):
    """A bad value of one named parameter (`param`, the SamplingParams field): offline it is
    a ValueError like any other; the server's 400 names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    dict=True,  # type: ignore[call-arg]
    kw_only=True,  # type: ignore[call-arg]
):
    """How to sample one request's output. `temperature=0` means greedy.

    Invalid values raise `ValueError` naming the field and the value at construction.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Structured outputs (see pagedllm.structured_output); guided_decoding is vLLM's old name.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    extra_args: dict[str, Any] | None = None

    # Filled in by the engine (Processor), not by users.
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    _eos_token_id: int | None = None
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ValueError(
                    f"logit_bias={self.logit_bias!r} must map token ids to floats"
                ) from e
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None and self.structured_outputs is None:
            self.structured_outputs = self.guided_decoding
        self.structured_outputs = as_structured_outputs_params(self.structured_outputs)
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect; normalize so batches stay simple.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        # Union, not assignment: __post_init__ also runs when msgspec decodes a copy.
        self._all_stop_token_ids.update(self.stop_token_ids)

    def _verify_args(self) -> None:
        def bad(field_name: str, value: Any, why: str) -> ValueError:
            return ParamValueError(f"{field_name} must be {why}, got {value!r}", field_name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.best_of is not None and self.best_of < self.n:
            raise bad("best_of", self.best_of, f"an integer >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0 or math.isinf(self.repetition_penalty):
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "a non-negative integer")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "a non-negative integer")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if self.allowed_token_ids is not None and (
            len(self.allowed_token_ids) == 0
            or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or any(not isinstance(w, str) for w in self.bad_words)
        ):
            raise bad("bad_words", self.bad_words, "a list of strings")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63
        ):
            raise bad("seed", self.seed, "an integer in [-2**63, 2**63 - 1]")
        if self.logit_bias is not None:
            out_of_range = {t: b for t, b in self.logit_bias.items() if not -100 <= b <= 100}
            if out_of_range:
                raise bad("logit_bias", out_of_range, "values in [-100, 100]")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` for the sampler. Each word is banned as written and, where the
        tokenizer has a distinct word-initial form of the same length, with a leading space."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain and plain not in sequences:
                sequences.append(plain)
            if (
                spaced
                and len(spaced) == len(plain)
                and spaced[0] != plain[0]
                and spaced not in sequences
            ):
                sequences.append(spaced)
        self._bad_words_token_ids = sequences

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_ids: list[int]
    ) -> None:
        """Record the model's EOS ids: the first is *the* EOS; any extra ones act as stop ids."""
        if eos_token_ids:
            self._eos_token_id = eos_token_ids[0]
            if not self.ignore_eos:
                self._all_stop_token_ids.update(eos_token_ids[1:])
        self._all_stop_token_ids.update(self.stop_token_ids)

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this one. The token-id lists and the bias
        dict are copied flat (their items are ints and floats): a deepcopy walks every item
        in Python, 10+ ms for an allowed_token_ids of the vocabulary's size, twice a request."""
        new = copy.copy(self)
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None:
                setattr(new, name, list(value))
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        new._all_stop_token_ids = set(self._all_stop_token_ids)
        if self._bad_words_token_ids is not None:
            new._bad_words_token_ids = [list(w) for w in self._bad_words_token_ids]
        for name in ("structured_outputs", "guided_decoding", "extra_args"):
            value = getattr(self, name)
            if value is not None:
                setattr(new, name, copy.deepcopy(value))
        return new

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if not f.startswith("_")
        )
        return f"SamplingParams({fields})"


class BeamSearchParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    dict=True,  # type: ignore[call-arg]
    kw_only=True,  # type: ignore[call-arg]
):
    """Beam search (vLLM's fields): keep the `beam_width` best partial sequences, extend each
    by its `2 * beam_width` most likely next tokens every step, for `max_tokens` steps.

    Candidates are scored by raw log-softmax; `temperature > 0` adds, per beam and step, one
    token sampled at that temperature to the candidates (vLLM's behaviour). A candidate that
    is EOS (unless `ignore_eos`) completes its sequence; finished sequences are ranked by
    `cum_logprob / len(prompt + output) ** length_penalty` (see `beam_search.py`).
    `include_stop_str_in_output` keeps a final EOS in the output tokens and text.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    @property
    def num_candidates(self) -> int:
        """Top tokens scored per beam and step (vLLM: twice the beam width)."""
        return 2 * self.beam_width
