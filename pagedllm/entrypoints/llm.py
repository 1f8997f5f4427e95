"""`LLM`: offline batched generation, vLLM's public face."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.chat_utils import render_chat
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """An engine for offline inference: `LLM(model=DIR, **engine_args).generate(prompts)`.

    Keyword arguments are `EngineArgs` fields (vLLM's names); an unknown one is a ValueError.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.llm_engine.config.model_config.get_diff_sampling_param())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = self._per_prompt(priority or 0, len(prompts), "priority")
        params = [sp.clone() for sp in params]
        for sp in params:
            sp.output_kind = RequestOutputKind.FINAL_ONLY
        return self._add_and_run(prompts, params, priorities, use_tqdm)

    def _add_and_run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams] | list[BeamSearchParams],
        priorities: list[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Validate and tokenize everything before the first request is scheduled, then run
        the engine until all are finished; results in the prompts' order."""
        engine = self.llm_engine
        ids = [str(next(self._request_counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, sp, prio in zip(ids, prompts, params, priorities):
                engine.add_request(rid, prompt, sp, priority=prio)
                added.append(rid)
        except Exception:
            engine.abort_request(added)
            raise
        return self._run_engine(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's signature); results in the prompts' order,
        each with its best `params.beam_width` sequences, best first. The search runs inside
        the engine: beams share their prefix's KV blocks. `concurrency_limit` bounds how
        many prompts are searched at once (default: all)."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: pagedllm has no LoRA adapters")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        limit = concurrency_limit or max(len(prompts), 1)
        tokenizer = self.get_tokenizer()
        results: list[BeamSearchOutput] = []
        for start in range(0, len(prompts), limit):
            batch = prompts[start : start + limit]
            for out in self._add_and_run(batch, [params] * len(batch), [0] * len(batch), use_tqdm):
                sequences = []
                for c in out.outputs:
                    tokens = [*out.prompt_token_ids, *c.token_ids]
                    sequences.append(
                        BeamSearchSequence(
                            tokens=tokens,
                            logprobs=c.logprobs or [],
                            cum_logprob=c.cumulative_logprob or 0.0,
                            text=tokenizer.decode(tokens),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                results.append(BeamSearchOutput(sequences=sequences))
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation through the tokenizer's chat template (with `tools`,
        `documents` and `chat_template_kwargs` passed to it, as the server does), then
        generate. Malformed messages or a failing template are a ValueError."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            text = render_chat(
                tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                documents=documents,
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine (its process, when it runs in one). Also done at exit."""
        self.llm_engine.shutdown()

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    @staticmethod
    def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass  # interpreter teardown: the client's own finalizer stops the process
