"""Continuous batching over a fixed set of KV-cache slots, with a per-step token budget.

Requests wait in arrival order (FCFS) and are admitted between model steps when all of
their ``n`` sequences fit and their prompt fits what is left of the step's token budget
(``--max-num-batched-tokens``, shared with the running sequences' decode rows); a finished
sequence leaves between steps too. A prompt longer than the budget is prefilled in chunks
instead (:meth:`Scheduler.start_chunked`): one at a time, its slots reserved until it is
placed. Running sequences always occupy slots ``0..B-1`` (the last one moves into a freed
slot), so a decode step reads the KV cache as one contiguous view and its batch row ``i``
is slot ``i``. The scheduler only does the bookkeeping; the runner owns tensors and applies
the slot moves it returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    """What admission needs to know about a waiting request."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_seqs(self) -> int: ...


class Placed(Protocol):
    """A running sequence: the scheduler keeps its ``slot`` up to date."""

    slot: int


R = TypeVar("R", bound=Waiting)
S = TypeVar("S", bound=Placed)


@dataclass(frozen=True)
class SlotMove:
    """The sequence in ``src`` now lives in ``dst``: copy its KV rows before the next step."""

    src: int
    dst: int


class Scheduler(Generic[R, S]):
    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[R] = deque()
        self.running: list[S] = []
        self.reserved = 0  # slots held for the request being prefilled in chunks

    @property
    def free_slots(self) -> int:
        return self.max_num_seqs - len(self.running) - self.reserved

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
        free = self.free_slots
        while self.waiting:
            head = self.waiting[0]
            tokens = cost(head)
            if head.num_seqs > free or tokens > budget:
                break
            admitted.append(self.waiting.popleft())
            free -= head.num_seqs
            budget -= tokens
        return admitted

    def start_chunked(self) -> R | None:
        """Pop the oldest request to prefill in chunks, its slots reserved until :meth:`unreserve`; None
        while another one is (one at a time) or its sequences do not fit the free slots."""
        if self.reserved or not self.waiting or self.waiting[0].num_seqs > self.free_slots:
            return None
        head = self.waiting.popleft()
        self.reserved = head.num_seqs
        return head

    def unreserve(self) -> None:
        """The chunked request is done (to be placed) or gone: its slots are free again."""
        self.reserved = 0

    def place(self, seq: S) -> int:
        """Give a newly admitted sequence the next slot (admission already reserved it)."""
        if not self.free_slots:
            raise RuntimeError("no free KV slot (admission and placement disagree)")
        seq.slot = len(self.running)
        self.running.append(seq)
        return seq.slot

    def release(self, seq: S) -> SlotMove | None:
        """Free a sequence's slot, keeping slots dense; returns the KV move to apply, if any.

        Release several sequences in descending slot order, so a move never picks a sequence
        that is about to be released too.
        """
        slot = seq.slot
        if not (0 <= slot < len(self.running) and self.running[slot] is seq):
            raise RuntimeError(f"sequence is not running in slot {slot}")
        last = self.running.pop()
        seq.slot = -1
        if last is seq:
            return None
        self.running[slot] = last
        last.slot = slot
        return SlotMove(src=len(self.running), dst=slot)
