"""Beam search inside the engine core: one `BeamGroup` per beam-search request.

A group's beams are ordinary `Request`s to the scheduler (they are scheduled, chunk-prefilled,
prefix-cached and preempted like any other), with two differences: the runner does not
sample them, it returns each beam's top `2 * beam_width` candidates for the next token
(`ModelRunnerOutput.beam_candidates`); and the group, not the request, decides what comes
next. Once every live beam has reported its candidates for the current length, `step`:

1. scores every candidate by its cumulative logprob; a candidate that is EOS (unless
   `ignore_eos`) becomes a finished hypothesis; the best `beam_width` others survive
   (they all have the same length, so cumulative logprob ranks them as the length-penalised
   score would);
2. forks: a beam with one surviving child simply takes the token; a beam with several keeps
   one and hands each other child a new `Request` that shares all of its KV blocks
   (`KVCacheManager.fork`; the partly filled last block is copied on first write); a beam
   with no surviving child is dropped and its blocks released (shared ones stay for the
   others);
3. after `max_tokens` steps (or at `max_model_len`) the search ends: the surviving beams join
   the finished hypotheses, which are ranked by `get_beam_search_score` (vLLM's rule), and
   the best `beam_width` are reported in one `EngineCoreOutput`.

So a step costs one forward row per beam and no prompt is ever recomputed, unlike
re-submitting one request per beam per step. The scheduler keeps a group all-in or all-out:
it admits all of a group's waiting beams together and preempts all of its running beams
together, so no half-admitted group can hold blocks while it waits for its siblings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.beam_search import get_beam_search_score
from pagedllm.core.kv_cache_utils import update_request_block_hashes
from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine import BeamSequenceOutput, EngineCoreOutput, FinishReason
from pagedllm.outputs import BeamCandidates

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.sampling_params import BeamSearchParams

# (token ids, logprobs, rank): the chosen token first, then the candidates scored with it.
LogprobsEntry = tuple[list[int], list[float], int]


@dataclass(frozen=True)
class _History:
    """A beam's logprob entries as a parent-linked list: forks share their common past."""

    entry: LogprobsEntry
    prev: _History | None

    def to_list(self) -> list[LogprobsEntry]:
        entries: list[LogprobsEntry] = []
        node: _History | None = self
        while node is not None:
            entries.append(node.entry)
            node = node.prev
        return entries[::-1]


@dataclass
class _Choice:
    parent: Request
    token_id: int
    cum_logprob: float
    history: _History


@dataclass
class BeamStep:
    """What one `BeamGroup.step` changed, for the scheduler to apply: beams it created
    (sharing their parents' blocks), beams it dropped (still holding their blocks), and the
    group's final output once the search is over."""

    new_beams: list[tuple[Request, Request]] = field(default_factory=list)  # (child, parent)
    dropped: list[Request] = field(default_factory=list)
    output: EngineCoreOutput | None = None


class BeamGroup:
    """The state of one beam search (see the module docstring). `beams` are the live beams,
    each a `Request` whose `beam_search` is the group's params."""

    def __init__(self, root: Request, kv_cache_manager: KVCacheManager, max_model_len: int):
        assert root.beam_search is not None
        self.root = root  # the user's request; its id names the group and its output
        self.params = root.beam_search
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.beams: list[Request] = [root]
        self._cum: dict[str, float] = {root.request_id: 0.0}
        self._history: dict[str, _History | None] = {root.request_id: None}
        self._pending: dict[str, BeamCandidates] = {}
        # Finished hypotheses: (output tokens, history, cum logprob, reason, stop reason).
        self._completed: list[tuple[list[int], _History, float, FinishReason, int | None]] = []
        self._num_forks = 0

    @property
    def request_id(self) -> str:
        return self.root.request_id

    def report(self, beam: Request, candidates: BeamCandidates) -> bool:
        """Record a beam's candidates; True once every live beam has reported."""
        self._pending[beam.request_id] = candidates
        return len(self._pending) == len(self.beams)

    def step(self) -> BeamStep:
        """Select, fork and drop (module docstring, 1-3). Call once `report` returned True."""
        choices = self._select()
        self._pending.clear()
        num_output = self.beams[0].num_output_tokens + 1  # all beams have the same length
        prompt_len = self.root.num_prompt_tokens
        if num_output >= self.params.max_tokens or prompt_len + num_output >= self.max_model_len:
            for c in choices:
                tokens = [*c.parent.output_token_ids, c.token_id]
                self._completed.append(
                    (tokens, c.history, c.cum_logprob, FinishReason.LENGTH, None)
                )
            return BeamStep(dropped=list(self.beams), output=self._final_output())
        return self._fork(choices)

    def _select(self) -> list[_Choice]:
        params, eos = self.params, self.root.eos_token_id
        scored: list[tuple[float, int, int]] = []  # (cum logprob, beam index, candidate index)
        for b, beam in enumerate(self.beams):
            ids, logprobs, _ = self._pending[beam.request_id]
            base = self._cum[beam.request_id]
            for j, (token_id, logprob) in enumerate(zip(ids, logprobs)):
                if token_id == eos and not params.ignore_eos:
                    tokens = list(beam.output_token_ids)
                    if params.include_stop_str_in_output:
                        tokens.append(token_id)
                    history = self._extend_history(beam, j)
                    cum = base + logprob
                    self._completed.append((tokens, history, cum, FinishReason.STOP, token_id))
                else:
                    scored.append((base + logprob, b, j))
        # Stable: among equal scores the earlier beam, then the better-ranked candidate, wins.
        scored.sort(key=lambda c: -c[0])
        choices = []
        for cum, b, j in scored[: params.beam_width]:
            beam = self.beams[b]
            token_id = self._pending[beam.request_id][0][j]
            choices.append(_Choice(beam, token_id, cum, self._extend_history(beam, j)))
        return choices

    def _extend_history(self, beam: Request, j: int) -> _History:
        """The beam's history plus the step that chose its candidate `j`."""
        ids, logprobs, ranks = self._pending[beam.request_id]
        entry = ([ids[j], *ids], [logprobs[j], *logprobs], ranks[j])
        return _History(entry, self._history[beam.request_id])

    def _fork(self, choices: list[_Choice]) -> BeamStep:
        step = BeamStep()
        kept: set[str] = set()
        beams: list[Request] = []
        for c in choices:
            if c.parent.request_id in kept:
                child = self._clone(c.parent)
                self.kv.fork(c.parent, child)
                step.new_beams.append((child, c.parent))
                beams.append(child)
            else:
                kept.add(c.parent.request_id)
                beams.append(c.parent)
        # Clones copied their parents' tokens above; now every beam takes its own token.
        block_size = self.kv.block_size
        for beam, c in zip(beams, choices):
            beam.append_output_token_ids(c.token_id)
            if self.kv.enable_caching:
                update_request_block_hashes(beam, block_size)
        step.dropped = [b for b in self.beams if b.request_id not in kept]
        self.beams = beams
        self._cum = {b.request_id: c.cum_logprob for b, c in zip(beams, choices)}
        self._history = {b.request_id: c.history for b, c in zip(beams, choices)}
        return step

    def _clone(self, parent: Request) -> Request:
        """A new beam with the parent's tokens and progress (not yet its new token)."""
        self._num_forks += 1
        child = Request(
            f"{self.request_id}#beam{self._num_forks}",
            parent.prompt_token_ids,
            parent.sampling_params,
            eos_token_id=parent.eos_token_id,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            beam_search=parent.beam_search,
            cache_salt=parent.cache_salt,
        )
        child.events.clear()  # the group reports the root's events only
        child.append_output_token_ids(list(parent.output_token_ids))
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes)
        child.status = RequestStatus.RUNNING
        return child

    def _final_output(self) -> EngineCoreOutput:
        """The best `beam_width` hypotheses by length-penalised score, best first."""
        params, eos, prompt = self.params, self.root.eos_token_id, self.root.prompt_token_ids

        def score(hyp: tuple) -> float:
            tokens, _, cum, _, _ = hyp
            return get_beam_search_score([*prompt, *tokens], cum, eos, params.length_penalty)

        best = sorted(self._completed, key=score, reverse=True)[: params.beam_width]
        sequences = [
            BeamSequenceOutput(
                token_ids=tokens,
                logprobs=history.to_list(),
                cum_logprob=cum,
                finish_reason=reason,
                stop_reason=stop_reason,
            )
            for tokens, history, cum, reason, stop_reason in best
        ]
        return EngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=[],
            finish_reason=sequences[0].finish_reason,
            num_cached_tokens=max(self.root.num_cached_tokens, 0),
            events=self.root.take_events(),
            beam_sequences=sequences,
        )


def check_beam_search_fits(
    params: BeamSearchParams,
    num_prompt_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    num_blocks: int | None,
) -> None:
    """ValueError unless a group can run alone: beam_width seats of max_num_seqs, and room
    for beam_width beams of the longest length it can reach (not counting the blocks they
    will share). `num_blocks` None: the cache is not sized yet, not checked."""
    if params.beam_width > max_num_seqs:
        raise ValueError(f"beam_width={params.beam_width} is more than max_num_seqs={max_num_seqs}")
    length = min(num_prompt_tokens + params.max_tokens, max_model_len)
    needed = params.beam_width * -(-length // block_size)
    if num_blocks is not None and needed > num_blocks:
        raise ValueError(
            f"beam search with beam_width={params.beam_width} over {length} tokens may need "
            f"{needed} KV blocks, more than the cache holds ({num_blocks}); lower beam_width "
            "or max_tokens, or enlarge the KV cache"
        )


class BeamSearchManager:
    """The scheduler's beam groups, found by group id (the user's request id) or by the id
    of any live beam."""

    def __init__(
        self, kv_cache_manager: KVCacheManager, max_model_len: int, max_num_seqs: int
    ) -> None:
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self._groups: dict[str, BeamGroup] = {}
        self._group_of_beam: dict[str, BeamGroup] = {}

    def check(self, request: Request) -> None:
        """ValueError unless the request's group fits alone (`check_beam_search_fits`)."""
        assert request.beam_search is not None
        check_beam_search_fits(
            request.beam_search,
            request.num_prompt_tokens,
            self.max_model_len,
            self.max_num_seqs,
            self.kv.block_size,
            self.kv.num_blocks,
        )

    def add(self, request: Request) -> None:
        group = BeamGroup(request, self.kv, self.max_model_len)
        self._groups[request.request_id] = group
        self._group_of_beam[request.request_id] = group

    def group(self, group_id: str) -> BeamGroup | None:
        return self._groups.get(group_id)

    def group_of(self, request: Request) -> BeamGroup | None:
        """The group `request` is a live beam of, or None for an ordinary request."""
        if request.beam_search is None:
            return None
        return self._group_of_beam.get(request.request_id)

    def apply(self, step: BeamStep, group: BeamGroup) -> None:
        """Track the beams a step created and forget those it dropped; a finished group is
        forgotten whole."""
        for child, _ in step.new_beams:
            self._group_of_beam[child.request_id] = group
        for beam in step.dropped:
            self._group_of_beam.pop(beam.request_id, None)
        if step.output is not None:
            self.remove(group)

    def remove(self, group: BeamGroup) -> None:
        self._groups.pop(group.request_id, None)
        for beam in group.beams:
            self._group_of_beam.pop(beam.request_id, None)

    def num_reserved_seats(self) -> int:
        """Seats (of max_num_seqs) promised to running groups still short of beam_width
        beams: a group runs one beam until its prompt is done, then beam_width."""
        return sum(
            g.params.beam_width - len(g.beams)
            for g in self._groups.values()
            if g.beams[0].status == RequestStatus.RUNNING
        )
