"""n > 1: one user request fans out into n child requests of n=1 in the engine core; the
ParentRequest gathers the children's completions back into one RequestOutput."""

from __future__ import annotations

import msgspec

from pagedllm.engine import EngineCoreRequest
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def fan_out(
    request: EngineCoreRequest,
) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
    """The engine-core requests for one user request, each with its parent and index:
    the request itself when n == 1, else n children of n = 1 under one ParentRequest."""
    if request.sampling_params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request.request_id, request.sampling_params)
    children = []
    for i in range(parent.n):
        child_id, child_params = parent.get_child_info(i)
        child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
        children.append((child, parent, i))
    return children


class ParentRequest:
    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.child_ids: list[str] = []
        self.completions: list[CompletionOutput | None] = [None] * self.n
        self.num_finished = 0
        self.max_num_generation_tokens = 0  # the longest finished child (metrics)

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """Child `index`'s request id and params (n=1; a seeded request gets seed + index,
        wrapped into the int64 range seeds must stay in, so the children differ yet stay
        reproducible)."""
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed = (params.seed + index + 2**63) % 2**64 - 2**63
        child_id = f"{index}_{self.request_id}"
        self.child_ids.append(child_id)
        return child_id, params

    def add_child_output(
        self, index: int, completion: CompletionOutput
    ) -> list[CompletionOutput] | None:
        """Record a child's output; return the completions to report now, or None to wait."""
        if completion.finished():
            self.num_finished += 1
        kind = self.sampling_params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            self.completions[index] = completion
            if self.num_finished < self.n:
                return None
            return [c for c in self.completions if c is not None]
        if kind == RequestOutputKind.DELTA:
            return [completion]
        self.completions[index] = completion
        return [c for c in self.completions if c is not None]

    def observe_finished(self, num_generation_tokens: int) -> None:
        """A child finished with `num_generation_tokens` tokens (for the metrics)."""
        self.max_num_generation_tokens = max(self.max_num_generation_tokens, num_generation_tokens)

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n
