"""The dashboard's data: one `DashboardStatLogger` per engine (a stat logger on `AsyncLLM`,
fed like the Prometheus and logging ones, plus the engine cores' snapshots), and `Dashboard`,
which ticks them once a second into a history of the last minutes and fans each tick out to
the pages listening over SSE.

A tick is one point per engine: generation and prompt tokens/s over the last second, TTFT
and inter-token latency p50 / p99 over the last `PERCENTILE_WINDOW_S` seconds (a single
second holds too few first tokens for a percentile), the mean step-time split of the steps
since the previous snapshot, KV usage and queue lengths. The engine cores send snapshots only
while at least one page listens (`AsyncLLM.set_engine_snapshots`), so an unwatched server
pays nothing for them; the tokens and latencies are kept from the start.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from pagedllm.engine import EngineSnapshot, SchedulerStats
from pagedllm.engine.async_llm import caller_request_id
from pagedllm.metrics.loggers import PrefixCacheRate
from pagedllm.metrics.stats import IterationStats

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

TICK_S = 1.0
HISTORY_POINTS = 300  # five minutes of ticks
PERCENTILE_WINDOW_S = 10.0
# The series of a point, in the order the page's charts read them.
POINT_FIELDS = (
    "t",
    "gen_tps",
    "prompt_tps",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "sched_ms",
    "model_ms",
    "sampling_ms",
    "output_ms",
    "kv_usage",
    "running",
    "waiting",
)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class DashboardStatLogger:
    """One engine's dashboard series. `record` / `record_snapshot` are called by AsyncLLM's
    output handler, `tick` by `Dashboard` once a second; all on the event loop."""

    def __init__(self, engine_index: int, window_s: float = PERCENTILE_WINDOW_S) -> None:
        self.engine_index = engine_index
        self.window_s = window_s
        self.prefix_cache = PrefixCacheRate()
        self.scheduler_stats = SchedulerStats()
        self.snapshot: EngineSnapshot | None = None
        self.history: deque[tuple[float | None, ...]] = deque(maxlen=HISTORY_POINTS)
        self._num_generation_tokens = 0
        self._num_prompt_tokens = 0
        self._ttfts: deque[tuple[float, float]] = deque()  # (monotonic time, seconds)
        self._itls: deque[tuple[float, float]] = deque()
        self._step_times: tuple[float, float, float, float] | None = None
        self._last_tick = time.monotonic()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        now = time.monotonic()
        if iteration_stats is not None:
            self._num_generation_tokens += iteration_stats.num_generation_tokens
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._ttfts.extend((now, v) for v in iteration_stats.time_to_first_tokens)
            self._itls.extend((now, v) for v in iteration_stats.inter_token_latencies)
        if scheduler_stats is not None:
            self.prefix_cache.observe(
                scheduler_stats.prefix_cache_queries, scheduler_stats.prefix_cache_hits
            )
            self.scheduler_stats = scheduler_stats

    def record_snapshot(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        if snapshot.num_steps:
            self._step_times = snapshot.step_times

    def log(self) -> None:
        """Nothing to print: the page is the output."""

    def tick(self, wall: float, now: float | None = None) -> tuple[float | None, ...]:
        """Close the second that ended at `now` (monotonic) into a history point at `wall`."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_tick, 1e-3)
        self._last_tick = now
        for window in (self._ttfts, self._itls):
            while window and window[0][0] < now - self.window_s:
                window.popleft()
        ttfts = [v for _, v in self._ttfts]
        itls = [v for _, v in self._itls]
        steps = self._step_times
        self._step_times = None
        stats = self.scheduler_stats
        point = (
            wall,
            self._num_generation_tokens / elapsed,
            self._num_prompt_tokens / elapsed,
            *(_ms(percentile(vs, q)) for vs in (ttfts, itls) for q in (0.5, 0.99)),
            *((s * 1000 for s in steps) if steps is not None else (None,) * 4),
            stats.kv_cache_usage,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
        )
        self._num_generation_tokens = self._num_prompt_tokens = 0
        self.history.append(point)
        return point

    def current(
        self, wall: float, caller_id: Callable[[str], str] = lambda request_id: request_id
    ) -> dict[str, Any]:
        """What the page shows besides the charts: block map, requests (named by
        `caller_id` of the engine's request id), counters."""
        stats = self.scheduler_stats
        state: dict[str, Any] = {
            "kv_usage": stats.kv_cache_usage,
            "prefix_hit_rate": self.prefix_cache.hit_rate,
            "running": stats.num_running_reqs,
            "waiting": stats.num_waiting_reqs,
        }
        snap = self.snapshot
        if snap is not None:
            state |= {
                "num_blocks": snap.num_blocks,
                "blocks_per_cell": snap.blocks_per_cell,
                "blocks": base64.b64encode(snap.block_states).decode(),
                "preemptions": snap.num_preemptions_total,
                "num_running": snap.num_running,
                "num_waiting": snap.num_waiting,
                "requests": [
                    [
                        caller_id(r.request_id),
                        r.status,
                        r.num_prompt_tokens,
                        r.num_computed_tokens,
                        r.num_output_tokens,
                        round(max(wall - r.arrival_time, 0.0), 1),
                        r.num_preemptions,
                    ]
                    for r in (*snap.running, *snap.waiting)
                ],
            }
        return state


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def engine_config_info(engine: AsyncLLM) -> dict[str, Any]:
    """The configuration the page lists (model, dtype, KV cache, limits, parallelism, ...)."""
    config = engine.config
    mc, cc, sc, pc = (
        config.model_config,
        config.cache_config,
        config.scheduler_config,
        config.parallel_config,
    )
    spec = config.extra.get("speculative_config")
    return {
        "model": mc.model,
        "served_model_name": mc.name,
        "dtype": str(getattr(mc, "dtype", "")).replace("torch.", ""),
        "device": config.device_config.device,
        "max_model_len": mc.max_model_len,
        "block_size": cc.block_size,
        "num_blocks": list(engine.engine_core.engine_num_blocks),
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "scheduling_policy": sc.policy,
        "tensor_parallel_size": pc.tensor_parallel_size,
        "pipeline_parallel_size": pc.pipeline_parallel_size,
        "data_parallel_size": pc.data_parallel_size,
        "speculative_config": _plain(spec),
        "attention_backend": config.attention_backend or "default",
        "stall_timeout_s": config.stall_timeout_s,
    }


def _plain(value: Any) -> Any:
    """A JSON-able form of a config object (dataclass, dict, or None)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is not None:
        return {k: _plain(getattr(value, k)) for k in fields}
    return str(value)


def sse(event: str | None, data: Any) -> bytes:
    """One server-sent event (JSON data)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Dashboard:
    """The front end's dashboard: per-engine loggers registered on `engine`, a ticker task
    (`start` / `stop`, on the server's event loop) and the SSE listeners (`listen`).
    `is_closing()` turning true (the server stops) ends every stream at the next tick, so an
    open page does not hold up a graceful shutdown."""

    def __init__(
        self,
        engine: AsyncLLM,
        tick_s: float = TICK_S,
        is_closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.is_closing = is_closing
        self.tick_s = tick_s
        self.loggers = [DashboardStatLogger(r) for r in range(engine.engine_core.num_engines)]
        for rank, stat_logger in enumerate(self.loggers):
            engine.add_stat_logger(stat_logger, rank)
        self.config = engine_config_info(engine)
        self._listeners: set[asyncio.Queue[bytes | None]] = set()
        self._snapshots_on = False
        self._calls: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="Dashboard")

    def stop(self) -> None:
        for task in (self._task, *self._calls):
            if task is not None:
                task.cancel()

    @property
    def num_listeners(self) -> int:
        return len(self._listeners)

    def health(self) -> list[str]:
        """Per engine: 'ok', or 'dead: why' / 'stalled: why'."""
        engine = self.engine
        if engine.errored:
            return [f"dead: {engine.dead_error}"] * len(self.loggers)
        dead, stalled = engine.dead_engines, engine.stalled_engines
        return [
            f"dead: {dead[r]}" if r in dead else f"stalled: {stalled[r]}" if r in stalled else "ok"
            for r in range(len(self.loggers))
        ]

    def _update(self, points: list[tuple[float | None, ...]], wall: float) -> dict[str, Any]:
        health = self.health()
        return {
            "t": wall,
            "engines": [
                {"point": point, "health": health[r], **lg.current(wall, caller_request_id)}
                for r, (lg, point) in enumerate(zip(self.loggers, points))
            ],
        }

    def init_message(self) -> dict[str, Any]:
        """The first event a page gets: configuration and each engine's history."""
        return {
            "config": self.config,
            "fields": POINT_FIELDS,
            "tick_s": self.tick_s,
            "history": [list(zip(*lg.history)) for lg in self.loggers],
        }

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self._tick()
            except Exception:  # a bad tick must not stop the page for good
                logger.exception("Dashboard tick failed")

    def _tick(self) -> None:
        wall = time.time()
        points = [lg.tick(wall) for lg in self.loggers]
        if not self._listeners:
            return
        message = None if self.is_closing() else sse(None, self._update(points, wall))
        for queue in self._listeners:
            if queue.full():  # a slow page skips a tick rather than lag behind
                queue.get_nowait()
            queue.put_nowait(message)

    async def listen(self) -> AsyncGenerator[bytes, None]:
        """One page's event stream: `init`, then an update every tick until it leaves."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
        self._listeners.add(queue)
        try:
            self._sync_snapshots()
            yield sse("init", self.init_message())
            while (message := await queue.get()) is not None:
                yield message
        finally:
            self._listeners.discard(queue)
            self._sync_snapshots()

    def _sync_snapshots(self) -> None:
        """Engine snapshots on while a page listens, off otherwise. Not awaited: a stalled
        engine answers no utility call, and the page must still load (and say so)."""
        wanted = bool(self._listeners)
        if wanted == self._snapshots_on or self.engine.errored:
            return
        self._snapshots_on = wanted
        task = asyncio.get_running_loop().create_task(self.engine.set_engine_snapshots(wanted))
        self._calls.add(task)
        task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("Could not switch the engine snapshots: %s", task.exception())
