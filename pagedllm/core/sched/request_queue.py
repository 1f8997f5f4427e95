"""Waiting queues of the scheduler: first-come-first-served, or by priority.

Both share one interface so the scheduler's admission loop does not care which is in use.
"Prepend" is for a request put back (preempted, or skipped this step): the FCFS queue puts it at
the front, the priority queue simply re-inserts it (its place follows from its priority and
arrival time, which did not change).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pagedllm.core.request import Request


class RequestQueue(ABC):
    """A queue of waiting requests. `peek_request`/`pop_request` give the next request to admit
    and raise IndexError when the queue is empty; `__iter__` yields requests in admission order."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None: ...

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put several requests back so they come out in the given order (FCFS)."""
        for request in reversed(list(requests)):
            self.prepend_request(request)

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order (a deque); put-back requests go to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A min-heap in `Request.__lt__` order: lower `priority` value first, then earlier
    arrival, then request id (a total order, so ties never depend on insertion)."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    """`policy` is SchedulerConfig.policy: 'fcfs' or 'priority'."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy={policy!r} must be 'fcfs' or 'priority'")
