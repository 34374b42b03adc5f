"""Scheduler bookkeeping: FCFS admission by free slots and the step's token budget, one chunked prefill at a
time with its slots reserved, slots that stay put, slots a KV hand-off holds beside the running batch."""

from dataclasses import dataclass

import pytest

from pdserve.engine.scheduler import Scheduler


@dataclass
class Req:
    request_id: str
    num_seqs: int = 1
    prompt_len: int = 10
    held_slot: int | None = None


def prompt_cost(r: Req) -> int:  # the cost the step loop passes: prompt tokens to compute
    return r.prompt_len


@dataclass(eq=False)
class Seq:
    name: str
    slot: int = -1


def test_admission_is_fcfs_and_never_skips_a_request_that_does_not_fit() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=4)
    for req in (Req("a", 3), Req("b", 2), Req("c", 1)):
        s.add(req)
    assert [r.request_id for r in s.admit(1000, prompt_cost)] == ["a"]
    for i in range(3):
        s.place(Seq(f"a{i}"))
    # b needs 2 slots, only 1 is free: c (which would fit) must not overtake it.
    assert s.admit(1000, prompt_cost) == []
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_the_token_budget_admits_whole_prompts_in_order_and_a_longer_one_waits_for_chunks() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=8)
    s.add(Req("x", prompt_len=60))
    s.add(Req("big", prompt_len=500))
    s.add(Req("y", prompt_len=10))
    assert [r.request_id for r in s.admit(100, prompt_cost)] == ["x"]  # big does not fit what is left; y waits behind it
    assert s.admit(100, prompt_cost) == []
    big = s.start_chunked()
    assert big is not None and big.request_id == "big" and s.reserved == [0] and s.free_slots == 7
    assert s.start_chunked() is None  # one chunked prefill at a time
    assert [r.request_id for r in s.admit(100, prompt_cost)] == ["y"]  # the queue moves on beside it
    s.unreserve()
    assert s.free_slots == 8


def test_a_pulled_decode_leg_costs_no_prompt_tokens() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=8)
    s.add(Req("pulled", prompt_len=5000))
    assert [r.request_id for r in s.admit(10, lambda r: 1)] == ["pulled"]


def test_reserved_slots_hold_back_admission() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=3)
    s.add(Req("long", num_seqs=2, prompt_len=900))
    s.add(Req("pair", num_seqs=2))
    assert s.start_chunked() is not None and s.free_slots == 1
    assert s.admit(1000, prompt_cost) == [] and s.start_chunked() is None


def test_a_sequence_keeps_its_slot_and_new_ones_take_the_lowest_free() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=4)
    seqs = [Seq(str(i)) for i in range(4)]
    for seq in seqs:
        s.place(seq)
    assert [q.slot for q in seqs] == [0, 1, 2, 3] and s.free_slots == 0
    s.release(seqs[2])
    s.release(seqs[0])
    assert [q.slot for q in seqs] == [-1, 1, -1, 3]  # the others did not move
    assert s.running == [seqs[1], seqs[3]] and s.free_slots == 2
    late = Seq("late")
    assert s.place(late) == 0  # the lowest free slot: the running ones stay packed
    with pytest.raises(RuntimeError, match="not running"):
        s.release(seqs[0])


def test_a_chunked_request_runs_into_its_reserved_slots() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=4)
    first = Seq("first")
    s.place(first)
    s.add(Req("long", num_seqs=2, prompt_len=900))
    assert s.start_chunked() is not None and s.reserved == [1, 2] and s.free_slots == 1
    other = Seq("other")
    assert s.place(other) == 3  # an admission beside it does not take the reserved slots
    a, b = Seq("a"), Seq("b")
    assert s.place(a, 1) == 1 and s.reserved == [2]
    s.unreserve()  # its sibling was stopped meanwhile: the slot it held is free again
    assert s.reserved == [] and s.free_slots == 1 and s.place(b) == 2


def test_remove_waiting_and_limits() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=2)
    s.add(Req("a"))
    assert s.remove_waiting("a") == Req("a")
    assert s.remove_waiting("a") is None and not s.has_work()
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.add(Req("too-wide", num_seqs=3))


def test_held_slots_stay_taken_and_count_against_slots_not_the_running_batch() -> None:
    """With a KV hand-off the cache has slots beyond max_num_seqs: a finished prefill leg's slot stays held (its
    KV waits there for the pull), a pull takes one to READ into; neither counts against max_num_seqs."""
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=2, num_slots=4)
    leg = Seq("prefill-leg")
    s.place(leg)
    assert s.hold(leg) == 0 and leg.slot == -1 and s.running == [] and s.held == {0}
    assert s.take_slot() == 1 and s.held == {0, 1} and s.free_slots == 2
    for name in ("a", "b", "c"):
        s.add(Req(name))
    assert [r.request_id for r in s.admit(1000, prompt_cost)] == ["a", "b"]  # max_num_seqs, though slots are free
    s.place(Seq("a"))
    s.place(Seq("b"))
    assert s.admit(1000, prompt_cost) == [] and s.take_slot() is None  # every slot taken
    s.free_slot(0)
    assert s.held == {1} and s.free_slots == 1
    with pytest.raises(KeyError):
        s.free_slot(0)


def test_a_pulled_request_is_admitted_into_the_slot_its_kv_landed_in() -> None:
    s: Scheduler[Req, Seq] = Scheduler(max_num_seqs=2, num_slots=3)
    landed = s.take_slot()
    assert landed == 0
    s.place(Seq("x"))
    s.place(Seq("y"))  # every free slot taken; the running batch is full
    s.add(Req("pulled", num_seqs=1, held_slot=landed))
    assert s.admit(1000, lambda r: 0) == []  # no room in the running batch yet
    s.release(s.running[0])
    other_pull = s.take_slot()  # and no free slot: it needs none
    assert [r.request_id for r in s.admit(1000, lambda r: 0)] == ["pulled"]
    assert s.place(Seq("pulled"), landed) == 0 and s.held == {other_pull}
    s.add(Req("pair", num_seqs=2, held_slot=None))
    assert s.admit(1000, lambda r: 0) == []  # its siblings need free slots


def test_the_cache_has_at_least_the_running_batchs_slots() -> None:
    with pytest.raises(ValueError, match="max_num_seqs slots"):
        Scheduler(max_num_seqs=4, num_slots=3)
