"""MessageQueue: every reader, local (shared-memory ring) or remote (ZMQ), gets every message in
order, through ring wrap-around, oversized messages and readers that fell asleep."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.distributed.shm_broadcast import MessageQueue

NUM_MESSAGES = 40


def _messages() -> list[object]:
    msgs: list[object] = [("step", i, list(range(i))) for i in range(NUM_MESSAGES)]
    msgs[7] = b"x" * 5000  # larger than a chunk: travels over ZMQ
    msgs[30] = {"big": list(range(3000))}
    return msgs


def _reader(handle, rank: int, delay_s: float, results) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    got = []
    for i in range(NUM_MESSAGES):
        if i == 20:
            time.sleep(delay_s)  # the writer runs ahead while this reader is slow
        got.append(mq.dequeue(timeout_s=60))
    results.put((rank, got))
    mq.close()


@pytest.mark.distributed
def test_local_and_remote_readers_get_every_message(worker_mp_context):
    ctx = worker_mp_context
    # Readers 0 and 2 read the ring; reader 1 is "remote" (ZMQ over loopback TCP).
    mq = MessageQueue(3, local_reader_ranks=[0, 2], max_chunk_bytes=1024, max_chunks=4,
                      connect_ip="127.0.0.1")  # fmt: skip
    handle = mq.export_handle()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_reader, args=(handle, rank, delay, results))
        for rank, delay in ((0, 0.0), (1, 0.0), (2, 0.3))
    ]
    for p in procs:
        p.start()
    mq.wait_until_ready(timeout_s=60)
    for i, m in enumerate(_messages()):
        if i == 10:
            time.sleep(0.2)  # readers go to sleep on the socket and must be woken
        mq.enqueue(m, timeout_s=60)
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    mq.close()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert got == {r: _messages() for r in range(3)}


def test_dequeue_times_out():
    mq = MessageQueue(1)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    mq.wait_until_ready(timeout_s=10)
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout_s=0.1)
    mq.enqueue("hello")
    assert reader.dequeue(timeout_s=5) == "hello"
    reader.close()
    mq.close()


def test_full_ring_blocks_the_writer():
    mq = MessageQueue(1, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    mq.wait_until_ready(timeout_s=10)
    mq.enqueue(1)
    mq.enqueue(2)
    with pytest.raises(TimeoutError):
        mq.enqueue(3, timeout_s=0.1)  # the reader has not consumed message 1 yet
    assert reader.dequeue(timeout_s=5) == 1
    mq.enqueue(3, timeout_s=5)
    assert [reader.dequeue(timeout_s=5), reader.dequeue(timeout_s=5)] == [2, 3]
    reader.close()
    mq.close()


def test_unclosed_queues_in_a_cycle_are_collected_without_blocking():
    """A writer and a reader never closed, held only by a reference cycle (as an engine whose
    start-up failed holds its executor's queues): garbage collection frees their sockets,
    contexts and the segment instead of blocking forever in a ZMQ context's term(). Runs in a
    child so that a regression fails here rather than hanging the suite."""
    code = """
import gc, os, sys
from pagedllm.distributed.shm_broadcast import MessageQueue
class Holder: pass
h = Holder(); h.cycle = h
h.writer = MessageQueue(1)
h.reader = MessageQueue.create_from_handle(h.writer.export_handle(), 0)
shm = "/dev/shm/" + h.writer.export_handle().shm_name.lstrip("/")
ipc = h.writer.export_handle().local_address.removeprefix("ipc://")
assert os.path.exists(shm) and os.path.exists(ipc)
del h
gc.collect()
assert not os.path.exists(shm) and not os.path.exists(ipc), "segment or ipc socket left"
print("COLLECTED")
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("garbage collection of unclosed message queues blocked")
    assert done.returncode == 0 and "COLLECTED" in done.stdout, done.stderr[-2000:]
