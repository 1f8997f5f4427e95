"""pagedllm: a vLLM-style LLM inference and serving engine."""

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestOutputKind",
    "__version__",
]


def __getattr__(name: str):
    # LLM and EngineArgs pull in torch/transformers: import them on first use only.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from pagedllm.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
