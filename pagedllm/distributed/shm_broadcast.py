"""`MessageQueue`: one writer broadcasts picklable messages to N readers, in order (vLLM's name).

Readers on the writer's host read a ring buffer in shared memory, so a broadcast costs a
pickle, one copy and a store, not a socket round trip per reader; readers elsewhere (remote)
get the same messages over a ZMQ PUB socket. Layout of the segment:

    [chunk_seq: one int64 per chunk][read_seq: one int64 per local reader][chunks]

each int64 on its own 64-byte line. Message m (0, 1, ...) goes to chunk m % C. The writer waits
until every local reader has consumed message m - C (`read_seq[r] >= m - C + 1`), writes the
pickled bytes, then stores `chunk_seq[m % C] = m + 1`; reader r waits for that store, reads,
then stores `read_seq[r] = m + 1`. A message larger than a chunk travels over ZMQ and the
chunk only says so. Like the shared-memory all-reduce, this relies on x86-64's store order.

Waiting: a reader spins for `spin_s` (a worker's next step message usually comes within
microseconds of finishing the last), then marks itself asleep and blocks on the ZMQ socket;
a writer that sees a sleeping reader sends it a wake-up. A reader that shares the writers'
cores and waits for a whole step (the executor, for a reply) should hardly spin at all. A reader that marked itself asleep
just as the message landed is not woken, so it also re-checks every `_SLEEP_POLL_MS`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import struct
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import zmq

from pagedllm.distributed.communicator import attach_shared_memory

_LINE = 64
_HEADER = struct.Struct("<BQ")  # overflow flag, payload length
DEFAULT_SPIN_S = 0.002  # spin this long before sleeping on the socket
_SLEEP_POLL_MS = 50
_TOPIC_LOCAL = b"L"  # wake-ups and oversized messages for local readers
_TOPIC_REMOTE = b"R"  # every message, for remote readers
_WAKE = b""


@dataclass
class Handle:
    """What a reader needs to attach (picklable; sent to the reader processes)."""

    n_reader: int
    local_reader_ranks: list[int]  # reader ranks that read the ring buffer
    shm_name: str | None
    max_chunks: int
    max_chunk_bytes: int
    local_address: str | None  # ipc:// for local readers' wake-ups and oversized messages
    remote_address: str | None  # tcp:// for remote readers


class MessageQueue:
    """Broadcast from one writer to `n_reader` readers (see the module docstring).

    The writer constructs it (`MessageQueue(n_reader, local_reader_ranks)`), hands
    `export_handle()` to the readers, and calls `wait_until_ready()` before its first
    `enqueue`; each reader calls `MessageQueue.create_from_handle(handle, rank)`. Every reader
    receives every message, in order. Not thread-safe on either side.
    """

    def __init__(
        self,
        n_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 8,
        connect_ip: str | None = None,
    ) -> None:
        local = list(range(n_reader)) if local_reader_ranks is None else list(local_reader_ranks)
        self._ctx = zmq.Context()
        self._is_writer = True
        self._n_local = len(local)
        self._shm = None
        self._ipc_dir = None
        local_address = remote_address = shm_name = None
        self._socket = self._ctx.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every subscription (handshake)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        if local:
            size = _LINE * (max_chunks + len(local)) + max_chunks * max_chunk_bytes
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self._shm.buf[: _LINE * (max_chunks + len(local))] = bytes(
                _LINE * (max_chunks + len(local))
            )
            shm_name = self._shm.name
            self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-mq-")
            local_address = f"ipc://{self._ipc_dir}/mq"
            self._socket.bind(local_address)
            self._map(self._shm.buf, max_chunks, max_chunk_bytes, len(local))
        if len(local) < n_reader:
            # Remote readers connect to `connect_ip` (default: this host's name's address).
            ip = connect_ip or socket.gethostbyname(socket.gethostname())
            port = self._socket.bind_to_random_port(f"tcp://{ip}")
            remote_address = f"tcp://{ip}:{port}"
        self._handle = Handle(
            n_reader=n_reader,
            local_reader_ranks=local,
            shm_name=shm_name,
            max_chunks=max_chunks,
            max_chunk_bytes=max_chunk_bytes,
            local_address=local_address,
            remote_address=remote_address,
        )
        self._n_remote = n_reader - len(local)
        self._next = 0
        self._finalizer = weakref.finalize(
            self, _release, self._socket, self._ctx, self._shm, self._ipc_dir
        )

    def _map(self, buf: Any, max_chunks: int, max_chunk_bytes: int, n_local: int) -> None:
        self._buf = buf
        self._max_chunks = max_chunks
        self._max_chunk_bytes = max_chunk_bytes
        self._chunk_seq = np.ndarray((max_chunks,), np.int64, buffer=buf, strides=(_LINE,))
        self._read_seq = np.ndarray(
            (n_local,), np.int64, buffer=buf, offset=_LINE * max_chunks, strides=(_LINE,)
        )
        # A reader's asleep flag lives in the second int64 of its read_seq line.
        self._asleep = np.ndarray(
            (n_local,), np.int64, buffer=buf, offset=_LINE * max_chunks + 8, strides=(_LINE,)
        )
        self._data_offset = _LINE * (max_chunks + n_local)

    def export_handle(self) -> Handle:
        return self._handle

    @staticmethod
    def create_from_handle(
        handle: Handle, rank: int, spin_s: float = DEFAULT_SPIN_S
    ) -> MessageQueue:
        """Reader `rank`'s end of the queue whose writer exported `handle`; it spins `spin_s`
        before sleeping on a wait (see the module docstring)."""
        self = MessageQueue.__new__(MessageQueue)
        self._spin_s = spin_s
        self._ctx = zmq.Context()
        self._is_writer = False
        self._handle = handle
        self._shm = None
        self._ipc_dir = None
        self._next = 0
        self._overflow: deque[bytes] = deque()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        if rank in handle.local_reader_ranks:
            self._local_rank = handle.local_reader_ranks.index(rank)
            buf, self._file = attach_shared_memory(handle.shm_name)
            self._map(
                buf, handle.max_chunks, handle.max_chunk_bytes, len(handle.local_reader_ranks)
            )
            self._socket.setsockopt(zmq.SUBSCRIBE, _TOPIC_LOCAL)
            self._socket.connect(handle.local_address)
        else:
            self._local_rank = None
            self._file = None
            self._socket.setsockopt(zmq.SUBSCRIBE, _TOPIC_REMOTE)
            self._socket.connect(handle.remote_address)
        self._finalizer = weakref.finalize(self, _release, self._socket, self._ctx, None, None)
        return self

    def wait_until_ready(self, timeout_s: float = 120.0) -> None:
        """Writer: block until every reader has subscribed (messages published before a
        subscription would be lost to it)."""
        assert self._is_writer
        deadline = time.monotonic() + timeout_s
        pending = self._handle.n_reader
        while pending:
            if not self._socket.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
                raise TimeoutError(f"{pending} message-queue reader(s) did not connect")
            if self._socket.recv()[:1] == b"\x01":  # a subscription (not an unsubscribe)
                pending -= 1

    # ---- writer --------------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout_s: float | None = None) -> None:
        """Broadcast `obj` to every reader. Blocks while the ring is full (a local reader is
        `max_chunks` messages behind); TimeoutError after `timeout_s`."""
        assert self._is_writer
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self._n_remote:
            self._socket.send_multipart([_TOPIC_REMOTE, data], copy=False)
        if self._n_local:
            self._write_local(data, timeout_s)
        self._next += 1

    def _write_local(self, data: bytes, timeout_s: float | None) -> None:
        m = self._next
        chunk = m % self._max_chunks
        need = m - self._max_chunks + 1  # message m - C consumed by every local reader
        _spin_until(lambda: int(self._read_seq.min()) >= need, timeout_s, "a reader to catch up")
        overflow = _HEADER.size + len(data) > self._max_chunk_bytes
        start = self._data_offset + chunk * self._max_chunk_bytes
        _HEADER.pack_into(self._buf, start, overflow, len(data))
        if overflow:
            self._socket.send_multipart([_TOPIC_LOCAL, data], copy=False)
        else:
            self._buf[start + _HEADER.size : start + _HEADER.size + len(data)] = data
        self._chunk_seq[chunk] = m + 1
        if self._asleep.any():
            self._socket.send_multipart([_TOPIC_LOCAL, _WAKE])

    # ---- reader --------------------------------------------------------------------------

    def dequeue(self, timeout_s: float | None = None) -> Any:
        """The next message. Blocks until it comes; TimeoutError after `timeout_s`."""
        assert not self._is_writer
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._local_rank is None:
            if not self._socket.poll(None if deadline is None else int(timeout_s * 1000)):
                raise TimeoutError("no message within the timeout")
            _, data = self._socket.recv_multipart()
            return pickle.loads(data)
        m = self._next
        chunk = m % self._max_chunks
        self._wait_local(chunk, m + 1, deadline)
        start = self._data_offset + chunk * self._max_chunk_bytes
        overflow, length = _HEADER.unpack_from(self._buf, start)
        if overflow:
            data = self._next_overflow()
        else:
            data = bytes(self._buf[start + _HEADER.size : start + _HEADER.size + length])
        self._read_seq[self._local_rank] = m + 1
        self._next += 1
        return pickle.loads(data)

    def _wait_local(self, chunk: int, seq: int, deadline: float | None) -> None:
        spin_end = time.monotonic() + self._spin_s
        spins = 0
        while self._chunk_seq[chunk] != seq:
            spins += 1
            if spins % 64:
                continue
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError("no message within the timeout")
            if now < spin_end:
                os.sched_yield()
                continue
            self._asleep[self._local_rank] = 1
            if self._chunk_seq[chunk] != seq:
                self._sleep(deadline)
            self._asleep[self._local_rank] = 0

    def _sleep(self, deadline: float | None) -> None:
        """Block on the socket until a wake-up (or an oversized message) arrives, or a short
        poll interval passes; stash oversized messages for `_next_overflow`."""
        wait_ms = _SLEEP_POLL_MS
        if deadline is not None:
            wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000)))
        if self._socket.poll(wait_ms):
            while self._socket.poll(0):
                _, data = self._socket.recv_multipart()
                if data:
                    self._overflow.append(data)

    def _next_overflow(self) -> bytes:
        while not self._overflow:
            _, data = self._socket.recv_multipart()
            if data:
                self._overflow.append(data)
        return self._overflow.popleft()

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the socket and the mapping; the writer also unlinks the segment (and its
        ipc directory). Idempotent."""
        if self._socket.closed:
            return
        for name in ("_chunk_seq", "_read_seq", "_asleep"):
            self.__dict__.pop(name, None)  # numpy views of the mapping go first
        buf = self.__dict__.pop("_buf", None)
        if self._shm is None and buf is not None:
            with contextlib.suppress(BufferError):
                buf.close()
            self._file.close()
        del buf
        self._finalizer()


def _release(sock: zmq.Socket, ctx: zmq.Context, shm: Any, ipc_dir: str | None) -> None:
    """Free a queue's socket and context, and the writer's segment and ipc directory: from
    `close()`, or when a queue is collected unclosed (say, in a reference cycle of an engine
    whose start-up failed). The finalizer holds the socket: pyzmq would otherwise finalize the
    context first, and its `term()` waits forever for the socket still open."""
    sock.close(linger=0)
    ctx.term()
    if shm is not None:
        with contextlib.suppress(BufferError):  # a stray view: freed with it
            shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()
    if ipc_dir is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _spin_until(ready, timeout_s: float | None, what: str) -> None:
    """Spin (yielding the CPU) until `ready()`; TimeoutError naming `what` after `timeout_s`."""
    if ready():
        return
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ready():
        os.sched_yield()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
