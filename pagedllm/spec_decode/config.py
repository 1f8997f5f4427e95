"""`SpeculativeConfig`: which proposer drafts tokens, how many, and from which checkpoint.

Built once from the user's dict (`LLM(..., speculative_config={...})`, or the server's
`--speculative-config JSON`) by `SpeculativeConfig.from_dict`, validated against the target
model, and stored in `EngineConfig.extra["speculative_config"]`; every layer reads it back with
`get_speculative_config(config)`. Field names are vLLM's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, ModelConfig

METHODS = ("ngram", "draft_model", "eagle", "medusa")
EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
MEDUSA_ARCHITECTURES = ("MedusaModel",)
# vLLM's defaults when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's names).

    - `method`: "ngram" (prompt lookup over the request's own tokens), "draft_model" (a smaller
      checkpoint with the target's vocabulary), "eagle" (an EAGLE head) or "medusa" (Medusa
      heads). Inferred from `model` when omitted.
    - `num_speculative_tokens` (k >= 1): draft tokens proposed per request and step.
    - `prompt_lookup_min` / `prompt_lookup_max`: n-gram sizes tried, longest first (ngram).
    - `model`: the draft / head checkpoint directory (not for ngram).
    - `draft_model_config`: the draft checkpoint's `ModelConfig` (filled in by `from_dict`).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_model_config: ModelConfig | None = field(default=None, repr=False)

    @classmethod
    def from_dict(
        cls, values: dict[str, Any] | str, target: ModelConfig | None = None
    ) -> SpeculativeConfig:
        """Validate the user's dict (or its JSON text) and, given the target's `ModelConfig`,
        load and check the draft checkpoint's config. Raises ValueError naming the field."""
        if isinstance(values, str):
            try:
                values = json.loads(values)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = {f.name for f in fields(cls)} - {"draft_model_config"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {unknown}; valid fields are "
                f"{sorted(known)}"
            )
        values = dict(values)
        if values.get("method") is None:
            values["method"] = _infer_method(values.get("model"))
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        config = cls(**values)
        config.validate()
        if target is not None and config.model is not None:
            config.draft_model_config = _draft_model_config(config, target)
        return config

    def validate(self) -> None:
        """Check the fields on their own (the draft checkpoint is checked by `from_dict`)."""
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method={self.method!r} is not supported; choose one of "
                f"{list(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k!r} must be an integer >= 1"
            )
        if self.method == "ngram":
            self._validate_ngram()
        elif self.model is None:
            raise ValueError(
                f"speculative_config.model is required for method={self.method!r} (a local "
                "checkpoint directory)"
            )
        elif not os.path.isdir(os.path.expanduser(str(self.model))):
            raise ValueError(
                f"speculative_config.model={self.model!r} is not an existing local directory"
            )

    def _validate_ngram(self) -> None:
        if self.model is not None:
            raise ValueError(
                f"speculative_config.model={self.model!r} must not be set for method='ngram'"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}={value!r} must be an integer >= 1")
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi


def get_speculative_config(config: EngineConfig) -> SpeculativeConfig | None:
    """The engine's `SpeculativeConfig`, or None when speculative decoding is off. A plain dict
    (a config built by hand) is validated here, without a draft-checkpoint check."""
    value = config.extra.get("speculative_config")
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    spec = SpeculativeConfig.from_dict(value, config.model_config)
    config.extra["speculative_config"] = spec
    return spec


def _read_config_json(model: str) -> dict[str, Any]:
    path = os.path.join(os.path.expanduser(str(model)), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative_config.model={model!r} has no config.json")
    with open(path) as f:
        return json.load(f)


def _infer_method(model: str | None) -> str:
    """vLLM's rule: no method and no model is an error; otherwise the checkpoint's
    architecture decides (EAGLE, Medusa, else a plain draft model)."""
    if model is None:
        raise ValueError(
            f"speculative_config.method is required (one of {list(METHODS)}) when no model is given"
        )
    if not os.path.isdir(os.path.expanduser(str(model))):
        raise ValueError(f"speculative_config.model={model!r} is not an existing local directory")
    archs = _read_config_json(model).get("architectures") or []
    if any(a in EAGLE_ARCHITECTURES for a in archs):
        return "eagle"
    if any(a in MEDUSA_ARCHITECTURES for a in archs):
        return "medusa"
    return "draft_model"


def _draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's `ModelConfig`: its own architecture and sizes, the target's
    dtype, max_model_len and tokenizer. Checks that it fits the target."""
    from dataclasses import replace

    from transformers import PretrainedConfig

    raw = _read_config_json(spec.model)
    if spec.method == "medusa":
        hf_config = PretrainedConfig(**raw)
    elif spec.method == "eagle" and raw.get("model_type") == "eagle" and "model" in raw:
        # vLLM's converted EAGLE checkpoints wrap the Llama config under "model".
        from transformers import LlamaConfig

        hf_config = LlamaConfig(**raw["model"])
        hf_config.architectures = raw.get("architectures")
    else:
        from pagedllm.transformers_utils.config import get_hf_config

        hf_config = get_hf_config(spec.model, trust_remote_code=target.trust_remote_code)
    draft = replace(
        target, model=spec.model, hf_config=hf_config, served_model_name=None, eos_token_ids=[]
    )
    vocab = getattr(hf_config, "vocab_size", None)
    if vocab != target.vocab_size:
        raise ValueError(
            f"speculative_config.model={spec.model!r} has vocab_size={vocab}, but the target "
            f"model has {target.vocab_size}; draft and target must share one vocabulary"
        )
    if spec.method in ("eagle", "medusa"):
        hidden = getattr(hf_config, "hidden_size", None)
        if hidden != target.hidden_size:
            raise ValueError(
                f"speculative_config.model={spec.model!r} has hidden_size={hidden}, but the "
                f"target model has {target.hidden_size}; an {spec.method} head reads the "
                "target's hidden states"
            )
    if spec.method == "medusa":
        num_heads = medusa_num_heads(hf_config)
        if spec.num_speculative_tokens > num_heads:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={spec.num_speculative_tokens} "
                f"exceeds the {num_heads} heads of the Medusa checkpoint {spec.model!r}"
            )
    return draft


def medusa_num_heads(hf_config: Any) -> int:
    """The number of heads a Medusa checkpoint's config declares."""
    return int(getattr(hf_config, "medusa_num_heads", None) or getattr(hf_config, "num_heads", 0))
