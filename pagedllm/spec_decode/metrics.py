"""Speculative-decoding statistics: counted by the scheduler, shown by the stat loggers.

The scheduler records, for every verified draft, how many draft tokens it had and how many of
them the target accepted (`SpecDecodingStats.observe_draft`), and ships the counts since the
last stats in `SchedulerStats.spec_decode` (a plain dict, so it crosses the process boundary
as msgpack). The front end's loggers turn them into vLLM's metrics:
`spec_decode_num_drafts`, `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`
and `spec_decode_num_accepted_tokens_per_pos` (Prometheus counters, `SpecDecodingProm`), and a
periodic log line with the acceptance rate and mean acceptance length
(`SpecDecodingLogging`). Mean acceptance length = 1 + accepted / drafts: the tokens one
verification step yields per request, the bonus token included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter


@dataclass
class SpecDecodingStats:
    """Counts since the last `take()`; `num_accepted_tokens_per_pos[i]` counts drafts whose
    token i (0-based) was accepted."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: it had `num_draft_tokens` drafts, the first
        `num_accepted_tokens` of which were accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise AssertionError(f"accepted {num_accepted_tokens} of {num_draft_tokens} drafts")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(min(num_accepted_tokens, len(per_pos))):
            per_pos[i] += 1

    def take(self) -> dict[str, Any] | None:
        """The counts as a dict (None if no draft was verified) and a reset."""
        if self.num_drafts == 0:
            return None
        out = {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        return out


class SpecDecodingLogging:
    """Aggregates `SchedulerStats.spec_decode` dicts between two `log()` calls and logs vLLM's
    line: draft acceptance rate, mean acceptance length, totals, per-position rates."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, stats: dict[str, Any] | None) -> None:
        if not stats:
            return
        self.num_drafts += stats["num_drafts"]
        self.num_draft_tokens += stats["num_draft_tokens"]
        self.num_accepted_tokens += stats["num_accepted_tokens"]
        per_pos = stats["num_accepted_tokens_per_pos"]
        if len(self.accepted_per_pos) < len(per_pos):
            self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
        for i, n in enumerate(per_pos):
            self.accepted_per_pos[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def log(self, logger: logging.Logger, engine_index: int = 0) -> None:
        """Log the line for the counts since the last call (nothing if there were none)."""
        if self.num_drafts == 0:
            return
        rate = self.num_accepted_tokens / max(self.num_draft_tokens, 1)
        per_pos = ", ".join(f"{n / self.num_drafts:.3f}" for n in self.accepted_per_pos)
        logger.info(
            "Engine %03d: SpecDecoding metrics: Draft acceptance rate: %.1f%%, Mean acceptance "
            "length: %.2f, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance "
            "rate: %s",
            engine_index,
            rate * 100,
            self.mean_acceptance_length,
            self.num_accepted_tokens,
            self.num_draft_tokens,
            per_pos,
        )
        self.reset()


class SpecDecodingProm:
    """vLLM's four spec-decode counters in a Prometheus registry, with vLLM's names.

    The counters are registered on the first stats that carry spec-decode counts, so an engine
    without speculative decoding exposes none of them.
    """

    def __init__(
        self, registry: CollectorRegistry, labelnames: list[str], labelvalues: tuple[str, ...]
    ) -> None:
        self.registry = registry
        self.labelnames = list(labelnames)
        self.labelvalues = tuple(labelvalues)
        self._counters: dict[str, Any] | None = None
        self._per_pos_family: Counter | None = None
        self._per_pos: list[Any] = []

    def _register(self) -> dict[str, Any]:
        def counter(name: str, doc: str) -> Any:
            return Counter(f"vllm:{name}", doc, self.labelnames, registry=self.registry).labels(
                *self.labelvalues
            )

        self._per_pos_family = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*self.labelnames, "position"],
            registry=self.registry,
        )
        return {
            "num_drafts": counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
            "num_draft_tokens": counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
            "num_accepted_tokens": counter(
                "spec_decode_num_accepted_tokens", "Number of accepted tokens."
            ),
        }

    def observe(self, stats: dict[str, Any] | None) -> None:
        if not stats:
            return
        if self._counters is None:
            self._counters = self._register()
        for key, metric in self._counters.items():
            metric.inc(stats[key])
        per_pos = stats["num_accepted_tokens_per_pos"]
        while len(self._per_pos) < len(per_pos):
            position = str(len(self._per_pos))
            self._per_pos.append(self._per_pos_family.labels(*self.labelvalues, position))
        for metric, n in zip(self._per_pos, per_pos):
            metric.inc(n)


class SpecDecodingRecorder(SpecDecodingLogging):
    """A stat logger (`record` / `log`) that only totals the spec-decode counts, for tests and
    benchmarks: `llm.llm_engine.stat_loggers.append(SpecDecodingRecorder())`."""

    def record(self, scheduler_stats: Any, iteration_stats: Any = None) -> None:
        if scheduler_stats is not None:
            self.observe(scheduler_stats.spec_decode)

    def log(self, *args: Any) -> None:  # totals are read directly, never logged
        pass
