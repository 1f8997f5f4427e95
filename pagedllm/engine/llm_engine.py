"""LLMEngine: the synchronous front end (`LLM` uses it): Processor -> EngineCore client ->
OutputProcessor, driven by `step()`."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.transformers_utils.tokenizer import get_tokenizer_while

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
        self.tokenizer, self.engine_core = get_tokenizer_while(
            lambda: EngineCoreClient.make_client(
                config, multiprocess_mode=multiprocess_mode, asyncio_mode=False
            ),
            mc.tokenizer,
            trust_remote_code=mc.trust_remote_code,
            overlap=not EngineCoreClient.runs_in_process(config, multiprocess_mode),
            tokenizer_mode=mc.tokenizer_mode,
        )
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(
            self.tokenizer, config.scheduler_config.stream_interval
        )
        config.cache_config.num_blocks = self.engine_core.num_blocks  # sized by the core
        self.stat_loggers = stat_loggers or []

    @property
    def model_config(self):
        """The model's config (`llm.llm_engine.model_config`, as in vLLM): dtype, lengths."""
        return self.config.model_config

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue one request; `BeamSearchParams` makes it a beam search (one final output
        with every beam)."""
        prompt_text, request = self.processor.process_inputs(
            request_id, prompt, params, arrival_time, priority
        )
        for child, parent, index in fan_out(request):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)

    def abort_request(self, request_ids: list[str]) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        if outputs.errored_requests is not None:
            return self._fail_requests(outputs.errored_requests)
        it = IterationStats() if self.stat_loggers else None
        processed = self.output_processor.process_outputs(outputs.outputs, it, outputs.timestamp)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for stat_logger in self.stat_loggers:
            stat_logger.record(outputs.scheduler_stats, it)
        return processed.request_outputs

    def _fail_requests(self, errored: dict[str, str]) -> list[RequestOutput]:
        """One data-parallel engine died while the others serve on. Its requests are dropped
        and the first one's error raised: offline generation cannot return a partial batch
        (`LLM.generate` aborts the rest)."""
        errors = {rid: EngineDeadError(f"({text})") for rid, text in errored.items()}
        self.engine_core.abort_requests(self.output_processor.fail_requests(errors))
        if errors:
            raise next(iter(errors.values()))
        return []

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
