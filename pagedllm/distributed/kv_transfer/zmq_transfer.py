"""KV blocks over TCP with ZMQ: a prefill engine serves them (`KVSender`), a decode engine
pulls them (`pull_kv_blocks`).

Protocol, one pull per request. The puller's DEALER sends one msgpack map
`{"engine_id", "request_id", "block_ids", "layout"}` naming the sender's engine, request and
blocks and the puller's block layout. The sender's ROUTER answers with a msgpack header
`{"ok": true, "num_layers": L}` (or `{"ok": false, "error": text}`), then one message per
layer, `[layer index, the blocks' bytes]`, so the puller writes layer l while later layers
are still on the wire. A pull with no block ids only tells the sender that its blocks are no
longer wanted. Either way the sender then releases the request's blocks (its scheduler frees
them), also when the pull fails; blocks nobody pulls are released after `hold_timeout_s`.

A dead peer is noticed at once, not after a timeout: the puller watches its socket's monitor
for a refused connection (the sender is gone) or a dropped one (it died mid-transfer).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedllm.distributed.kv_transfer.kv_blocks import PagedKVBlocks, tensor_bytes

logger = logging.getLogger(__name__)

_POLL_MS = 100
# How long a pull may arrive before the sender has registered the request (the kv_transfer
# params reach the client right after the step that finished it; registration takes one more
# step).
_REGISTRATION_WAIT_S = 5.0


class KVTransferError(RuntimeError):
    """A pull did not bring every block (the request is then recomputed)."""


@dataclass
class _Held:
    block_ids: list[int]
    deadline: float
    in_progress: bool = False


@dataclass
class KVSender:
    """Serves this engine's KV blocks to pullers from a background thread.

    Contract: `register` the blocks a request holds for pulling; `take_released` returns the
    requests whose blocks the scheduler may free (pulled, refused, or expired). The blocks of
    a registered request must not change until it is released.
    """

    kv: PagedKVBlocks
    engine_id: str
    host: str
    port: int
    hold_timeout_s: float
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _held: dict[str, _Held] = field(default_factory=dict)
    _released: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{self.host}:{self.port}")
        self._thread = threading.Thread(target=self._serve, name="kv-sender", daemon=True)
        self._thread.start()

    def register(self, req_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._held[req_id] = _Held(block_ids, time.monotonic() + self.hold_timeout_s)
            self._lock.notify_all()

    def take_released(self) -> set[str]:
        """Requests released since the last call, including those nobody pulled in time."""
        now = time.monotonic()
        with self._lock:
            for req_id, held in list(self._held.items()):
                if not held.in_progress and now > held.deadline:
                    logger.warning(
                        "KV blocks of request %s were not pulled within %.0fs; freeing them",
                        req_id,
                        self.hold_timeout_s,
                    )
                    del self._held[req_id]
                    self._released.add(req_id)
            released, self._released = self._released, set()
        return released

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            try:
                if not self._socket.poll(_POLL_MS):
                    continue
                identity, payload = self._socket.recv_multipart()
                self._handle(identity, decoder.decode(payload))
            except zmq.ZMQError:
                if not self._stop.is_set():
                    logger.exception("KV sender socket failed")
                return
            except Exception:
                logger.exception("KV sender failed to serve a pull")

    def _handle(self, identity: bytes, pull: dict[str, Any]) -> None:
        """Answer one pull; the request's blocks are released once its answer is out (a
        refusal releases them before answering: the puller will not come back)."""
        req_id = str(pull.get("request_id"))
        held = self._claim(req_id)
        block_ids = list(pull.get("block_ids") or [])
        error = self._check(pull, held, block_ids)
        if error is not None:
            self._release(req_id, held)
            self._reply(identity, {"ok": False, "error": error})
            return
        try:
            num_layers = self.kv.num_layers if block_ids else 0
            self._reply(identity, {"ok": True, "num_layers": num_layers})
            for layer in range(num_layers):
                data = tensor_bytes(self.kv.gather(layer, block_ids))
                self._socket.send_multipart(
                    [identity, msgspec.msgpack.encode(layer), data], copy=False
                )
        finally:
            self._release(req_id, held)

    def _release(self, req_id: str, held: _Held | None) -> None:
        if held is not None:
            with self._lock:
                self._held.pop(req_id, None)
                self._released.add(req_id)

    def _claim(self, req_id: str) -> _Held | None:
        """The request's held blocks, marked in progress (waiting a little for a registration
        that may still be on its way); None if it holds none."""
        deadline = time.monotonic() + _REGISTRATION_WAIT_S
        with self._lock:
            while req_id not in self._held and time.monotonic() < deadline:
                self._lock.wait(timeout=0.05)
            held = self._held.get(req_id)
            if held is not None:
                held.in_progress = True
            return held

    def _check(self, pull: dict[str, Any], held: _Held | None, block_ids: list[int]) -> str | None:
        if pull.get("engine_id") != self.engine_id:
            return f"this is engine {self.engine_id}, not {pull.get('engine_id')}"
        if held is None:
            return f"request {pull.get('request_id')} holds no KV blocks here (freed or unknown)"
        if not set(block_ids) <= set(held.block_ids):
            return f"blocks {block_ids} are not all held by request {pull.get('request_id')}"
        if block_ids and pull.get("layout") != self.kv.describe():
            return f"block layout {pull.get('layout')} differs from {self.kv.describe()}"
        return None

    def _reply(self, identity: bytes, header: dict[str, Any]) -> None:
        self._socket.send_multipart([identity, msgspec.msgpack.encode(header)])

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close()
        self._ctx.term()


_DEAD_PEER_EVENTS = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED


def pull_kv_blocks(
    ctx: zmq.Context,
    kv: PagedKVBlocks,
    host: str,
    port: int,
    pull: dict[str, Any],
    local_block_ids: list[int],
    timeout_s: float,
) -> None:
    """Pull `pull["block_ids"]` of the sender at host:port into `local_block_ids`, layer by
    layer. Raises `KVTransferError` on refusal, a dead or silent peer, or a short answer; the
    blocks are then partly written and must not be used."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(_DEAD_PEER_EVENTS)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s

    def wait_readable() -> None:
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise KVTransferError(f"no answer from the KV sender at {address} in {timeout_s}s")
            events = dict(poller.poll(left_ms))
            if monitor in events:
                event = recv_monitor_message(monitor)["event"]
                name = "refused" if event == zmq.EVENT_CONNECT_RETRIED else "dropped"
                raise KVTransferError(f"connection to the KV sender at {address} {name}")
            if sock in events:
                return

    try:
        sock.connect(f"tcp://{address}")
        sock.send(msgspec.msgpack.encode({**pull, "layout": kv.describe()}))
        wait_readable()
        header = msgspec.msgpack.decode(sock.recv())
        if not header.get("ok"):
            raise KVTransferError(f"the KV sender at {address} refused: {header.get('error')}")
        if not local_block_ids:
            return
        # Each layer's bytes land in one writable staging buffer, then in the cache.
        staging = torch.empty(len(local_block_ids) * kv.block_numel, dtype=kv.dtype)
        staging_bytes = staging.view(torch.uint8).numpy()
        layers_done: set[int] = set()
        for _ in range(header.get("num_layers", 0)):
            wait_readable()
            layer = msgspec.msgpack.decode(sock.recv())
            if not sock.get(zmq.RCVMORE) or sock.recv_into(staging_bytes) != staging_bytes.size:
                raise KVTransferError(f"layer {layer} from {address} has the wrong size")
            kv.scatter(layer, local_block_ids, staging)
            layers_done.add(layer)
        if layers_done != set(range(kv.num_layers)):
            raise KVTransferError(f"{address} sent layers {sorted(layers_done)} only")
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
