"""LLMEngine: the synchronous front end (`LLM` uses it): Processor -> EngineCore client ->
OutputProcessor, driven by `step()`."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.config import EngineConfig, env_flag
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.transformers_utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds requests, steps the engine core, returns RequestOutputs. Single-threaded."""

    def __init__(
        self,
        config: EngineConfig,
        multiprocess_mode: bool | None = None,
        stat_loggers: list[Any] | None = None,
    ) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=bool(stat_loggers))
        if multiprocess_mode is None:
            multiprocess_mode = env_flag("PAGEDLLM_ENABLE_MULTIPROCESSING", True)
        self.engine_core = EngineCoreClient.make_client(
            config, multiprocess_mode=multiprocess_mode, asyncio_mode=False
        )
        self.stat_loggers = stat_loggers or []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        prompt_text, request = self.processor.process_inputs(
            request_id, prompt, params, arrival_time, priority
        )
        n = request.sampling_params.n
        if n == 1:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core.add_request(request)
            return
        parent = ParentRequest(request_id, request.sampling_params)
        for i in range(n):
            child_id, child_params = parent.get_child_info(i)
            child = _with(request, request_id=child_id, sampling_params=child_params)
            self.output_processor.add_request(child, prompt_text, parent, i)
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        it = IterationStats() if self.stat_loggers else None
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp, it)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for stat_logger in self.stat_loggers:
            stat_logger.record(outputs.scheduler_stats, it)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _with(request: Any, **changes: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(request, **changes)
