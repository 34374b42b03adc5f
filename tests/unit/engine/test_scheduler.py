"""Scheduler bookkeeping: FCFS admission by free slots, prefill budget, dense slots."""

from dataclasses import dataclass

import pytest

from pdserve.engine.scheduler import Scheduler, SlotMove


@dataclass
class Req:
    request_id: str
    num_seqs: int = 1
    prompt_len: int = 10


@dataclass(eq=False)
class Seq:
    name: str
    slot: int = -1


def test_admission_is_fcfs_and_never_skips_a_request_that_does_not_fit() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=4, max_prefill_tokens=1000)
    for req in (Req("a", 3), Req("b", 2), Req("c", 1)):
        s.add(req)
    assert [r.request_id for r in s.admit()] == ["a"]
    for i in range(3):
        s.place(Seq(f"a{i}"))
    # b needs 2 slots, only 1 is free: c (which would fit) must not overtake it.
    assert s.admit() == []
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_prefill_budget_limits_requests_per_step_but_always_admits_one() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=8, max_prefill_tokens=100)
    s.add(Req("big", prompt_len=500))
    s.add(Req("x", prompt_len=60))
    s.add(Req("y", prompt_len=60))
    assert [r.request_id for r in s.admit()] == ["big"]
    assert [r.request_id for r in s.admit()] == ["x"]
    assert [r.request_id for r in s.admit()] == ["y"]


def test_release_keeps_slots_dense_and_reports_the_move() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=4, max_prefill_tokens=1000)
    seqs = [Seq(str(i)) for i in range(4)]
    for seq in seqs:
        s.place(seq)
    assert [q.slot for q in seqs] == [0, 1, 2, 3]
    assert s.release(seqs[1]) == SlotMove(src=3, dst=1)
    assert seqs[3].slot == 1 and seqs[1].slot == -1
    assert s.running == [seqs[0], seqs[3], seqs[2]]
    assert s.release(seqs[2]) is None  # the last slot leaves without a move
    assert [q.slot for q in s.running] == [0, 1]


def test_remove_waiting_and_limits() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=2, max_prefill_tokens=1000)
    s.add(Req("a"))
    assert s.remove_waiting("a") == Req("a")
    assert s.remove_waiting("a") is None and not s.has_work()
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.add(Req("too-wide", num_seqs=3))
