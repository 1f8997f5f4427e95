"""Per-token output bookkeeping for the scheduler: stop checks and logprob layouts.

`check_stop` runs after every appended token, so a request never keeps tokens past its stop.
Prompt logprobs arrive chunk by chunk (one chunk per step of a chunked prefill);
`PromptLogprobsAccumulator` files each entry under its prompt position, so a chunk that is
recomputed after a preemption overwrites instead of duplicating.
"""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.outputs import LogprobsLists

# (token ids, logprobs, rank of the sampled token): EngineCoreOutput's per-position layout.
LogprobsEntry = tuple[list[int], list[float], int]


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether `request` stops after its latest output token; if so set its status (and
    `stop_reason`) and return True.

    Order: a stop token only counts once `min_tokens` outputs exist; EOS stops unless
    `ignore_eos` (stop_reason None); a token in `all_stop_token_ids` stops with stop_reason =
    that token; otherwise reaching `max_tokens` outputs or `max_model_len` total tokens caps the
    length. So an EOS sampled as the last allowed token reports "stop", not "length".
    """
    params = request.sampling_params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens and num_output > 0:
        last = request.output_token_ids[-1]
        eos = request.eos_token_id if request.eos_token_id is not None else params.eos_token_id
        if not params.ignore_eos and eos is not None and last == eos:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if last in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = request.max_tokens
    if (max_tokens is not None and num_output >= max_tokens) or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def logprobs_entries(lists: LogprobsLists, start: int, count: int) -> list[LogprobsEntry]:
    """Rows [start, start + count) of `lists` as EngineCoreOutput entries."""
    return [
        (lists.token_ids[i], lists.logprobs[i], lists.ranks[i]) for i in range(start, start + count)
    ]


class PromptLogprobsAccumulator:
    """One request's prompt logprobs, collected over its prefill chunks.

    `entries[p]` is the logprob entry of prompt token p (predicted from position p - 1);
    `entries[0]` is always None. Runner contract: for a chunk that ran prompt positions
    [start, start + n), the LogprobsLists rows are for prompt tokens start + 1,
    start + 2, ... up to at most P - 1 (the last prompt position predicts a sampled token).
    """

    def __init__(self, num_prompt_tokens: int) -> None:
        self.entries: list[LogprobsEntry | None] = [None] * num_prompt_tokens
        self.num_filled = 0

    @property
    def complete(self) -> bool:
        return self.num_filled >= len(self.entries) - 1

    def add(self, start: int, lists: LogprobsLists) -> None:
        """File the rows of one chunk that started at prompt position `start`."""
        num_prompt = len(self.entries)
        for j in range(len(lists.ranks)):
            pos = start + 1 + j
            if pos >= num_prompt:
                break
            if self.entries[pos] is None:
                self.num_filled += 1
            self.entries[pos] = (lists.token_ids[j], lists.logprobs[j], lists.ranks[j])
