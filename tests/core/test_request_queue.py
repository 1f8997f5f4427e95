"""Tests for pagedllm.core.sched.request_queue: FCFS and priority queues."""

import pytest

from pagedllm.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from tests.core.utils import create_requests


def ids(queue):
    return [r.request_id for r in queue]


def test_fcfs_order_prepend_and_remove():
    r = create_requests(4)
    queue = create_request_queue("fcfs")
    assert isinstance(queue, FCFSRequestQueue)
    for request in r[:3]:
        queue.add_request(request)
    assert queue.peek_request() is r[0]
    assert queue.pop_request() is r[0]
    queue.prepend_request(r[0])
    queue.prepend_requests([r[3], r[2]])  # come out in the given order, before the rest
    assert ids(queue) == ["req3", "req2", "req0", "req1", "req2"]
    queue.remove_requests([r[3], r[2]])
    assert ids(queue) == ["req0", "req1"]
    queue.remove_request(r[0])
    assert ids(queue) == ["req1"] and len(queue) == 1 and queue


def test_fcfs_prepend_requests_keeps_their_order():
    r = create_requests(3)
    queue = FCFSRequestQueue()
    queue.add_request(r[2])
    queue.prepend_requests([r[0], r[1]])
    assert ids(queue) == ["req0", "req1", "req2"]


def test_priority_order_and_ties():
    # Priorities 2, 0, 1, 0: lower value first, then earlier arrival.
    r = create_requests(4, priorities=[2, 0, 1, 0])
    queue = create_request_queue("priority")
    assert isinstance(queue, PriorityRequestQueue)
    for request in reversed(r):
        queue.add_request(request)
    assert ids(queue) == ["req1", "req3", "req2", "req0"]
    assert queue.peek_request() is r[1]
    popped = queue.pop_request()
    queue.prepend_request(popped)  # goes back to its place
    assert ids(queue) == ["req1", "req3", "req2", "req0"]
    queue.remove_request(r[3])
    assert [queue.pop_request().request_id for _ in range(len(queue))] == ["req1", "req2", "req0"]
    assert not queue
    with pytest.raises(IndexError):
        queue.peek_request()


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        create_request_queue("lifo")
