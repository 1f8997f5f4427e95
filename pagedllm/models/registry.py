"""Architecture name (config.json's `architectures`) -> model class, imported on first use."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    # architecture: (module under pagedllm.models, class name)
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


class ModelRegistry:
    """Lazy registry: a model module is imported only when its architecture is asked for."""

    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def load_model_cls(architecture: str) -> type[nn.Module]:
        if architecture not in _MODELS:
            raise ValueError(
                f"model architecture {architecture!r} is not supported; supported "
                f"architectures: {', '.join(ModelRegistry.get_supported_archs())}"
            )
        module_name, cls_name = _MODELS[architecture]
        module = importlib.import_module(f"pagedllm.models.{module_name}")
        return getattr(module, cls_name)

    @staticmethod
    def resolve_model_cls(architectures: list[str] | None) -> tuple[type[nn.Module], str]:
        """The first supported architecture's class and name."""
        for arch in architectures or []:
            if arch in _MODELS:
                return ModelRegistry.load_model_cls(arch), arch
        raise ValueError(
            f"model architectures {list(architectures or [])} are not supported; supported "
            f"architectures: {', '.join(ModelRegistry.get_supported_archs())}"
        )


def resolve_model_cls(architectures: list[str] | None) -> type[nn.Module]:
    """The model class for a config's `architectures` list; ValueError naming them otherwise."""
    return ModelRegistry.resolve_model_cls(architectures)[0]
