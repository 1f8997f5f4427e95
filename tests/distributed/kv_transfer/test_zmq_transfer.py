"""KV blocks over ZMQ (zmq_transfer.py): a pull copies exactly the asked blocks, layer by
layer, and releases them at the sender; refusals, unknown requests, expiry, and a sender that
is gone or dies mid-transfer all end the pull with KVTransferError, fast."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import torch
import zmq

from pagedllm.distributed.kv_transfer.kv_blocks import PagedKVBlocks, tensor_bytes
from pagedllm.distributed.kv_transfer.zmq_transfer import (
    KVSender,
    KVTransferError,
    pull_kv_blocks,
)

NUM_BLOCKS, LAYERS = 8, 3
SHAPE = (2, NUM_BLOCKS, 4, 2, 8)  # the torch backend's layout: blocks on dim 1


def make_kv(seed: int | None, dtype: torch.dtype = torch.float32) -> PagedKVBlocks:
    """Caches of `dtype` (an fp8 one: as kv_cache_dtype="fp8" stores them), random or zero."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = {
        f"l{i}": (torch.randn(SHAPE, generator=gen) if gen else torch.zeros(SHAPE)).to(dtype)
        for i in range(LAYERS)
    }
    return PagedKVBlocks(caches, block_dim=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def sender():
    s = KVSender(make_kv(0), "prefill-engine", "127.0.0.1", free_port(), hold_timeout_s=30)
    yield s
    s.shutdown()


def pull(ctx, sender, local, local_ids, **overrides):
    request = {"engine_id": "prefill-engine", "request_id": "r", "block_ids": [1, 3], **overrides}
    pull_kv_blocks(ctx, local, "127.0.0.1", sender.port, request, local_ids, timeout_s=10)


def test_pull_copies_the_blocks_and_releases_them(ctx, sender):
    sender.register("r", [1, 3, 4])
    local = make_kv(None)
    pull(ctx, sender, local, [6, 0])
    for layer in range(LAYERS):
        assert torch.equal(local.gather(layer, [6, 0]), sender.kv.gather(layer, [1, 3]))
        assert local.gather(layer, [1, 2, 3]).abs().sum() == 0  # nothing else written
    deadline = time.monotonic() + 5
    while not (released := sender.take_released()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released == {"r"} and sender.num_held == 0


def test_registration_may_arrive_after_the_pull(ctx, sender):
    threading.Timer(0.3, sender.register, args=("r", [1, 3])).start()
    local = make_kv(None)
    pull(ctx, sender, local, [2, 5])
    assert torch.equal(local.gather(0, [2, 5]), sender.kv.gather(0, [1, 3]))


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"engine_id": "another"}, "not another"),
        ({"block_ids": [1, 7]}, "not all held"),
    ],
)
def test_refused_pulls(ctx, sender, overrides, match):
    sender.register("r", [1, 3])
    with pytest.raises(KVTransferError, match=match):
        pull(ctx, sender, make_kv(None), [0, 1], **overrides)
    assert sender.num_held == 0  # a refused pull still releases the blocks


def test_fp8_blocks_move_byte_for_byte_and_only_into_fp8(ctx):
    """kv_cache_dtype fp8: blocks arrive as their stored bytes; a puller whose cache keeps
    another dtype is refused (its layout differs), never sent bytes it would misread."""
    s = KVSender(make_kv(0, torch.float8_e4m3fn), "e", "127.0.0.1", free_port(), 30)
    try:
        s.register("r", [1, 3])
        local = make_kv(None, torch.float8_e4m3fn)
        request = {"engine_id": "e", "request_id": "r", "block_ids": [1, 3]}
        pull_kv_blocks(ctx, local, "127.0.0.1", s.port, request, [5, 2], timeout_s=10)
        for layer in range(LAYERS):
            sent = s.kv.gather(layer, [1, 3]).view(torch.uint8)
            assert torch.equal(local.gather(layer, [5, 2]).view(torch.uint8), sent)
            assert sent.any()
        s.register("r2", [1])
        request = {**request, "request_id": "r2", "block_ids": [1]}
        for other in (torch.float8_e5m2, torch.bfloat16):
            with pytest.raises(KVTransferError, match="layout"):
                pull_kv_blocks(ctx, make_kv(None, other), "127.0.0.1", s.port, request, [0], 10)
            s.register("r2", [1])  # a refused pull releases the blocks
    finally:
        s.shutdown()


def test_unpulled_blocks_expire():
    s = KVSender(make_kv(0), "e", "127.0.0.1", free_port(), hold_timeout_s=0.2)
    try:
        s.register("r", [1])
        assert s.take_released() == set()
        time.sleep(0.3)
        assert s.take_released() == {"r"}
    finally:
        s.shutdown()


def test_no_sender_fails_fast(ctx):
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="refused"):
        request = {"engine_id": "e", "request_id": "r", "block_ids": [0]}
        pull_kv_blocks(ctx, make_kv(None), "127.0.0.1", free_port(), request, [0], 30)
    assert time.monotonic() - t0 < 5


def test_sender_dying_mid_transfer_fails_fast(ctx):
    """A sender that answers the header and one layer, then disappears."""
    port = free_port()
    kv = make_kv(0)

    def half_sender() -> None:
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{port}")
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, msgspec.msgpack.encode({"ok": True, "num_layers": 3})])
        router.send_multipart(
            [identity, msgspec.msgpack.encode(0), tensor_bytes(kv.gather(0, [1]))]
        )
        time.sleep(0.2)
        router.close(linger=0)

    thread = threading.Thread(target=half_sender)
    thread.start()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="dropped"):
        request = {"engine_id": "e", "request_id": "r", "block_ids": [1]}
        pull_kv_blocks(ctx, make_kv(None), "127.0.0.1", port, request, [0], 30)
    assert time.monotonic() - t0 < 5
    thread.join()
