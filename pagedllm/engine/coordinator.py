"""DPCoordinator: the process that ties data-parallel engine cores and their front ends together.

It runs whenever there is more than one engine core, more than one front end (API server) or
an engine on another node. All its sockets are bound by the coordinator; their addresses go
to the parent over a pipe, and from there into the start-up handshake.

- input (PULL). From engines: `["counts", rank, waiting, running]` whenever their queue
  lengths change and at least every `HEARTBEAT_INTERVAL_S` (the engine's heartbeat);
  `["wave_done", rank, wave]` (lockstep seam, below). From whoever owns an engine process:
  `["dead", rank, reason]` as soon as that process exits.
- front publish (XPUB). To every front end: `{"counts": [[waiting, running], ...],
  "dead": {rank: reason}}`, when something changed (at most every `PUBLISH_INTERVAL_S`), and
  at once when a new front end subscribes. Front ends balance on these counts.
- engine publish (XPUB). To every engine: `[EngineCoreRequestType, payload]` frames:
  `SHUTDOWN` when the coordinator stops (so engines on other nodes stop with the head), and
  `START_DP_WAVE` for lockstep waves.

Liveness: an engine silent for `PAGEDLLM_DP_HEARTBEAT_TIMEOUT_S` (default 10) after its first
message is published as dead; that covers engines on other nodes, whose processes nobody on
this node can watch. Local engine processes are reported at once by their owner.

Lockstep seam. Dense models need no lockstep between engines, so the engines never use it
today. MoE expert parallelism will: each engine reports the end of its wave of steps, and
`WaveBarrier` decides when every live engine has, upon which the coordinator broadcasts
`START_DP_WAVE` with the next wave number.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from pagedllm.engine import EngineCoreRequestType

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_ENV = "PAGEDLLM_DP_HEARTBEAT_TIMEOUT_S"
PUBLISH_INTERVAL_S = 0.05
_POLL_S = 0.2
_START_TIMEOUT_S = 60.0


class WaveBarrier:
    """The lockstep seam: when has every live engine finished wave `wave`?

    Contract: `engine_done(rank, wave)` and `engine_dead(rank)` return the number of the wave
    to start when this report completes the current one, else None. Reports for other waves
    than the current one are stale and ignored."""

    def __init__(self, num_engines: int) -> None:
        self.wave = 0
        self._alive = set(range(num_engines))
        self._done: set[int] = set()

    def engine_done(self, rank: int, wave: int) -> int | None:
        if wave != self.wave or rank not in self._alive:
            return None
        self._done.add(rank)
        return self._advance()

    def engine_dead(self, rank: int) -> int | None:
        self._alive.discard(rank)
        self._done.discard(rank)
        return self._advance()

    def _advance(self) -> int | None:
        if not self._alive or not self._alive <= self._done:
            return None
        self.wave += 1
        self._done.clear()
        return self.wave


class CoordinatorState:
    """What the coordinator knows: each engine's last counts, when it was last heard from,
    and which engines are dead (with why). Pure; the process loop feeds it."""

    def __init__(self, num_engines: int, heartbeat_timeout_s: float) -> None:
        self.counts = [[0, 0] for _ in range(num_engines)]
        self.dead: dict[int, str] = {}
        self.last_seen: dict[int, float] = {}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.barrier = WaveBarrier(num_engines)

    def on_counts(self, rank: int, waiting: int, running: int, now: float) -> bool:
        """Returns whether the published view changed."""
        if rank in self.dead or not 0 <= rank < len(self.counts):
            return False
        self.last_seen[rank] = now
        changed = self.counts[rank] != [waiting, running]
        self.counts[rank] = [waiting, running]
        return changed

    def on_dead(self, rank: int, reason: str) -> bool:
        if rank in self.dead or not 0 <= rank < len(self.counts):
            return False
        logger.error("DP engine %d is dead: %s", rank, reason)
        self.dead[rank] = reason
        self.counts[rank] = [0, 0]
        self.last_seen.pop(rank, None)
        return True

    def check_heartbeats(self, now: float) -> list[int]:
        """Declares dead, and returns, the engines silent for longer than the timeout."""
        silent = [r for r, t in self.last_seen.items() if now - t > self.heartbeat_timeout_s]
        for rank in silent:
            self.on_dead(rank, f"no heartbeat for {self.heartbeat_timeout_s:.0f}s")
        return silent

    def snapshot(self) -> dict[str, Any]:
        return {"counts": self.counts, "dead": self.dead}


class DPCoordinator:
    """Handle on the coordinator process, held by whoever launched the engines.

    `host=None` binds ipc sockets in `ipc_dir` (every engine and front end on this node);
    otherwise TCP on `host` (engines on other nodes). `shutdown()` stops the process, which
    tells every engine to stop on its way out."""

    def __init__(self, num_engines: int, host: str | None, ipc_dir: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_coordinator,
            name="DPCoordinator",
            kwargs=dict(
                num_engines=num_engines,
                bind_prefix=f"tcp://{host}" if host else f"ipc://{ipc_dir}/coordinator",
                addr_pipe=writer,
                parent_pid=os.getpid(),
            ),
            daemon=True,
        )
        from pagedllm.spawn import main_module_hidden

        with main_module_hidden(None):
            self.proc.start()
        writer.close()
        try:
            if not reader.poll(_START_TIMEOUT_S):
                raise RuntimeError("the DP coordinator did not start in time")
            addresses = reader.recv()
        except (EOFError, RuntimeError) as e:
            self.shutdown()
            raise RuntimeError(f"the DP coordinator failed to start: {e}") from None
        finally:
            reader.close()
        self.input_address: str = addresses["input"]
        self.front_publish_address: str = addresses["front"]
        self.engine_publish_address: str = addresses["engines"]

    def shutdown(self) -> None:
        """Idempotent: SIGTERM (the coordinator then stops the engines), then kill."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5.0)


def report_engine_death(ctx: zmq.Context, coordinator_input: str, rank: int, reason: str) -> None:
    """Tell the coordinator (and through it every front end) that engine `rank` died."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(coordinator_input)
        sock.send(msgspec.msgpack.encode(["dead", rank, reason]))
    finally:
        sock.close()


class DPCoordinatorProc:
    """The coordinator's loop (see the module docstring), in its own process."""

    def __init__(self, num_engines: int, bind_prefix: str, parent_pid: int) -> None:
        timeout = float(os.environ.get(HEARTBEAT_TIMEOUT_ENV, "10"))
        self.state = CoordinatorState(num_engines, timeout)
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self._bind(zmq.PULL, bind_prefix, "input")
        self.front = self._bind(zmq.XPUB, bind_prefix, "front")
        self.engines = self._bind(zmq.XPUB, bind_prefix, "engines")
        # A wave broadcast must reach engines that subscribe late; a SHUTDOWN on exit must
        # leave before the context is closed.
        self.engines.setsockopt(zmq.LINGER, 2000)

    def _bind(self, kind: int, prefix: str, name: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if prefix.startswith("tcp://"):
            sock.bind(f"{prefix}:*")
        else:
            sock.bind(f"{prefix}-{name}")
        return sock

    def addresses(self) -> dict[str, str]:
        return {
            name: sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            for name, sock in (
                ("input", self.input),
                ("front", self.front),
                ("engines", self.engines),
            )
        }

    def run(self) -> None:
        """Until the parent dies or a signal arrives (SystemExit)."""
        poller = zmq.Poller()
        for sock in (self.input, self.front, self.engines):
            poller.register(sock, zmq.POLLIN)
        changed, last_publish = True, 0.0
        while os.getppid() == self.parent_pid:
            events = dict(poller.poll(int(_POLL_S * 1000)))
            now = time.monotonic()
            if self.input in events:
                changed |= self._drain_input(now)
            if self.front in events and self._new_subscriber():
                changed, last_publish = True, 0.0
            if self.engines in events:
                self.engines.recv()  # subscription notices; nothing to do
            for rank in self.state.check_heartbeats(now):
                changed = True
                self._start_wave(self.state.barrier.engine_dead(rank))
            if changed and now - last_publish >= PUBLISH_INTERVAL_S:
                self.front.send(msgspec.msgpack.encode(self.state.snapshot()))
                changed, last_publish = False, now
        logger.warning("The DP coordinator's parent %d died; stopping", self.parent_pid)

    def _drain_input(self, now: float) -> bool:
        changed = False
        while True:
            try:
                msg = msgspec.msgpack.decode(self.input.recv(zmq.NOBLOCK))
            except zmq.Again:
                return changed
            kind = msg[0]
            if kind == "counts":
                changed |= self.state.on_counts(msg[1], msg[2], msg[3], now)
            elif kind == "dead":
                if self.state.on_dead(msg[1], msg[2]):
                    changed = True
                    self._start_wave(self.state.barrier.engine_dead(msg[1]))
            elif kind == "wave_done":
                self._start_wave(self.state.barrier.engine_done(msg[1], msg[2]))
            else:
                logger.error("DP coordinator: unknown message %r ignored", kind)

    def _start_wave(self, wave: int | None) -> None:
        if wave is not None:
            payload = msgspec.msgpack.encode(wave)
            self.engines.send_multipart([EngineCoreRequestType.START_DP_WAVE.value, payload])

    def _new_subscriber(self) -> bool:
        new = False
        while True:
            try:
                new |= self.front.recv(zmq.NOBLOCK)[:1] == b"\x01"
            except zmq.Again:
                return new

    def close(self) -> None:
        """Tell every engine to stop, then close the sockets."""
        self.engines.send_multipart([EngineCoreRequestType.SHUTDOWN.value])
        for sock in (self.input, self.front):
            sock.close()
        self.engines.close()
        self.ctx.term()


def run_coordinator(num_engines: int, bind_prefix: str, addr_pipe: Any, parent_pid: int) -> None:
    """Entry point of the coordinator process."""
    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
        format="%(levelname)s %(asctime)s [DPCoordinator pid=%(process)d] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )

    def _on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    coordinator = DPCoordinatorProc(num_engines, bind_prefix, parent_pid)
    try:
        addr_pipe.send(coordinator.addresses())
        addr_pipe.close()
        coordinator.run()
    except SystemExit:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        coordinator.close()
