"""Continuous batching over a fixed set of KV-cache slots, with a per-step token budget.

Requests wait in arrival order (FCFS) and are admitted between model steps when all of
their ``n`` sequences fit and their prompt fits what is left of the step's token budget
(``--max-num-batched-tokens``, shared with the running sequences' decode rows); a finished
sequence leaves between steps too. A prompt longer than the budget is prefilled in chunks
instead (:meth:`Scheduler.start_chunked`): one at a time, its slots reserved until it is
placed. A sequence keeps its slot from placement to release: its keys/values never move (a decode step
reads each run of consecutive slots as a view, and slots are handed out lowest first, so the running ones
stay packed). The scheduler only does the bookkeeping; the runner owns the tensors.

With a KV hand-off there are more slots than ``max_num_seqs`` (``--kv-handoff-slots``): a slot may also be
*held*, outside the running batch, by a finished prefill leg whose KV waits for its pull, or by a decode leg
whose pull READs into it. Held slots do not count against ``max_num_seqs``; a pulled request is admitted with
its held slot (its first sequence runs there, where the KV already is).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    """What admission needs to know about a waiting request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_seqs(self) -> int: ...

    @property
    def held_slot(self) -> int | None:
        """A held slot its first sequence will run in (its pulled KV is there), else None."""
        ...


class Placed(Protocol):
    """A running sequence: the scheduler keeps its ``slot`` up to date."""

    slot: int


R = TypeVar("R", bound=Waiting)
S = TypeVar("S", bound=Placed)


class Scheduler(Generic[R, S]):
    def __init__(self, max_num_seqs: int, num_slots: int | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        num_slots = max_num_seqs if num_slots is None else num_slots
        if num_slots < max_num_seqs:
            raise ValueError("the KV cache needs at least max_num_seqs slots")
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[R] = deque()
        self.running: list[S] = []
        self.reserved: list[int] = []  # slots held for the request being prefilled in chunks
        self.held: set[int] = set()  # slots hand-offs hold outside the running batch
        self._free = list(range(num_slots))  # a heap: the lowest free slot first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def room(self) -> int:
        """Sequences that may still join the running batch (``max_num_seqs`` less those running or reserved)."""
        return self.max_num_seqs - len(self.running) - len(self.reserved)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: R) -> None:
        if request.num_seqs > self.max_num_seqs:
            raise ValueError(f"request needs {request.num_seqs} sequences; max_num_seqs is {self.max_num_seqs}")
        self.waiting.append(request)

    def remove_waiting(self, request_id: str) -> R | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None

    def admit(self, budget: int, cost: Callable[[R], int]) -> list[R]:
        """Pop the requests to prefill whole this step, oldest first, while their sequences fit the free
        slots and their ``cost`` (prompt tokens to compute) what is left of ``budget``; never skips past
        one that does not fit."""
        admitted: list[R] = []
        free, room = self.free_slots, self.room
        while self.waiting:
            head = self.waiting[0]
            tokens = cost(head)
            needs_free = head.num_seqs - (head.held_slot is not None)
            if head.num_seqs > room or needs_free > free or tokens > budget:
                break
            admitted.append(self.waiting.popleft())
            free -= needs_free
            room -= head.num_seqs
            budget -= tokens
        return admitted

    def start_chunked(self) -> R | None:
        """Pop the oldest request to prefill in chunks, its slots reserved (:attr:`reserved`, the first one its
        chunks run into) until it is placed or :meth:`unreserve`; None while another one is (one at a time) or
        its sequences do not fit the free slots."""
        if self.reserved or not self.waiting or self.waiting[0].num_seqs > min(self.free_slots, self.room):
            return None
        head = self.waiting.popleft()
        self.reserved = [heapq.heappop(self._free) for _ in range(head.num_seqs)]
        return head

    def unreserve(self) -> None:
        """The chunked request is gone before its placement: its reserved slots are free again."""
        for slot in self.reserved:
            heapq.heappush(self._free, slot)
        self.reserved = []

    def place(self, seq: S, slot: int | None = None) -> int:
        """Give a newly admitted sequence the lowest free slot (admission already counted it), or ``slot``: one of
        the chunked request's :attr:`reserved` slots, or the :attr:`held` slot its pulled KV landed in."""
        if slot is not None:
            if slot in self.held:
                self.held.remove(slot)
            else:
                self.reserved.remove(slot)
        elif not self._free:
            raise RuntimeError("no free KV slot (admission and placement disagree)")
        else:
            slot = heapq.heappop(self._free)
        seq.slot = slot
        self.running.append(seq)
        return slot

    def release(self, seq: S) -> None:
        """Free a sequence's slot; the others stay where they are."""
        self._leave(seq)
        heapq.heappush(self._free, seq.slot)
        seq.slot = -1

    def hold(self, seq: S) -> int:
        """A finished sequence leaves the running batch but its slot stays taken (a prefill leg's KV waits there
        for its pull): :meth:`free_slot` frees it later. Returns the slot."""
        self._leave(seq)
        slot, seq.slot = seq.slot, -1
        self.held.add(slot)
        return slot

    def take_slot(self) -> int | None:
        """The lowest free slot, held outside the running batch (a pull READs into it); None when none is free."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self.held.add(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        """A held slot is free again (its lease ended, its pull failed or was dropped)."""
        self.held.remove(slot)
        heapq.heappush(self._free, slot)

    def _leave(self, seq: S) -> None:
        if seq.slot < 0 or seq not in self.running:
            raise RuntimeError(f"sequence is not running in slot {seq.slot}")
        self.running.remove(seq)
