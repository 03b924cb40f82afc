"""The running loop's scheduler (ocrq/models/loop/) on the CPU, no torch: ticks of
`schedule -> StepOutput -> update` driven by a runner simulated here, as vLLM v1's scheduler
tests drive theirs. (It took the place of the Hunyuan loop's own admission policy; until then a
test here checked, tick for tick, that both made the same plans.)"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import pytest

from ocrq.models.loop import LoopScheduler, Request, SchedulerConfig, StepOutput, StepPlan
from ocrq.models.loop.lane_pass import LanePolicy
from ocrq.models.slots import KvPool, capacity_of


def tick(s: LoopScheduler, finished: tuple[str, ...] = (), steps: int = 1,
         now: float = 0.0) -> StepPlan:
    s.update(StepOutput(steps, finished))
    return s.schedule(now)


def test_a_row_is_admitted_into_a_slot_and_range_and_handed_back_once() -> None:
    s = LoopScheduler(SchedulerConfig(slots=2, pool_tokens=1024, max_new_tokens=32))
    s.add([Request("a", 100), Request("b", 50, max_new_tokens=4), Request("c", 80)], 0.0)
    plan = s.schedule(0.0)
    assert [(a.key, a.slot, a.start) for a in plan.admit] == [("a", 0, 0), ("b", 1, 144)]
    assert [a.capacity for a in plan.admit] == [capacity_of(100, 32), capacity_of(50, 4)]
    assert [a.row_cap for a in plan.admit] == [32, 4]
    assert plan.blocked == "no free slot" and plan.decode_steps == 1  # "c" waits: ask again
    assert s.pool.free_tokens == 1024 - 144 - 64
    assert s.update(StepOutput(4, ("b",))) == ("b",)
    assert s.update(StepOutput(0, ("b",))) == ()  # a late copy names it again: not twice
    plan = s.schedule(0.0)
    assert [(a.key, a.slot) for a in plan.admit] == [("c", 1)]  # the freed slot
    assert plan.decode_steps == s.config.check_every  # nothing waits
    assert s.update(StepOutput(3, ("a", "c"))) == ("a", "c")
    assert s.idle() and s.pool == KvPool.empty(1024) and s.step == 7


def test_rows_the_loop_cannot_take_are_refused_when_queued() -> None:
    s = LoopScheduler(SchedulerConfig(slots=2, pool_tokens=256, max_new_tokens=32))
    with pytest.raises(ValueError, match="over the pool"):
        s.add([Request("big", 300)], 0.0)
    with pytest.raises(ValueError, match="outside"):
        s.add([Request("x", 10, max_new_tokens=33)], 0.0)
    s.add([Request("a", 10)], 0.0)
    with pytest.raises(ValueError, match="in the loop already"):
        s.add([Request("a", 10)], 0.0)


def test_a_dropped_row_frees_its_slot_for_the_same_plan_and_never_comes_back() -> None:
    s = LoopScheduler(SchedulerConfig(slots=1, pool_tokens=512, max_new_tokens=8))
    s.add([Request("a", 100), Request("b", 100), Request("c", 100)], 0.0)
    assert [a.key for a in s.schedule(0.0).admit] == ["a"]
    assert s.drop({"a", "b"}) == ["b", "a"]  # waiting "b" at once, running "a" as well
    plan = s.schedule(0.0)
    assert plan.drop == ("a",) and [(a.key, a.slot) for a in plan.admit] == [("c", 0)]
    assert s.update(StepOutput(1, ("a", "c"))) == ("c",)  # "a" was dropped, not finished
    assert s.schedule(0.0).drop == () and s.idle()


def test_chunked_passes_wait_for_the_gap_unless_an_interactive_row_waits() -> None:
    s = LoopScheduler(SchedulerConfig(slots=8, pool_tokens=4096, max_new_tokens=16,
                                      prefill_gap=4))
    s.add([Request("a", 50)], 0.0)
    assert len(s.schedule(0.0).admit) == 1
    s.add([Request("b", 50)], 0.0)
    for _ in range(3):
        assert tick(s).admit == ()  # rows decode meanwhile: fewer, fuller passes
    assert [a.key for a in tick(s).admit] == ["b"]
    s.add([Request("c", 50), Request("i", 50, interactive=True)], 0.0)
    assert [a.key for a in tick(s).admit] == ["i", "c"]  # at once, and first


def test_with_interactive_only_steps_the_reserve_is_the_lowest_slots() -> None:
    """Bulk rows take slots above the reserve, an interactive row the lowest reserved one, where
    the runner's interactive-only step over the first slots covers it (which slots that step
    covers is the runner's: it follows the rows live on the device)."""
    lanes = LanePolicy(reserved_slots=2, extra_steps=2)
    s = LoopScheduler(SchedulerConfig(slots=40, pool_tokens=1 << 16, max_new_tokens=16,
                                      lanes=lanes))
    s.add([Request(f"b{i}", 20) for i in range(20)], 0.0)
    plan = s.schedule(0.0)
    assert {a.slot for a in plan.admit} == set(range(2, 22))
    s.add([Request("i", 20, interactive=True)], 0.0)
    plan = tick(s)
    assert [(a.key, a.slot) for a in plan.admit] == [("i", 0)]


def simulate(config: SchedulerConfig, seed: int, rows: int = 120) -> None:
    """A runner under random arrivals: each admitted row ends after a random number of steps
    within its cap, reported some steps late (a copy of the slots' state read later), and named
    again now and then. The books are checked at every tick."""
    rng = random.Random(seed)
    s = LoopScheduler(config)
    pending = [Request(f"r{i}", rng.randint(8, 600), rng.choice([None, rng.randint(1, 64)]),
                       rng.random() < 0.25) for i in range(rows)]
    ends: dict[str, int] = {}  # key -> the step it is seen finished
    done: list[str] = []
    for _ in range(20000):
        if pending and rng.random() < 0.4:
            batch = pending[: rng.randint(1, 4)]
            pending = pending[len(batch):]
            s.add(batch, float(s.step))  # one step a second: promotion after 64 steps
        plan = s.schedule(float(s.step))
        for a in plan.admit:
            ends[a.key] = s.step + rng.randint(1, a.row_cap) + rng.randint(0, 3)
        running = s.running
        slots = [a.slot for a in running.values()]
        assert len(slots) == len(set(slots)) and all(0 <= x < config.slots for x in slots)
        bulk = sum(not a.interactive for a in running.values())
        assert bulk <= config.slots - config.lanes.reserved_slots
        spans = sorted((a.start, a.start + a.capacity) for a in running.values())
        assert all(e <= b for (_, e), (b, _) in itertools.pairwise(spans))
        held = sum(a.capacity for a in running.values())
        assert s.pool.free_tokens == config.pool_tokens - held  # the book adds up
        steps = plan.decode_steps if running else 0
        now = s.step + steps
        seen = tuple(k for k, at in ends.items() if at <= now)
        again = tuple(rng.sample(done, min(len(done), 2)))  # late copies name rows again
        got = s.update(StepOutput(steps, seen + again))
        assert set(got) == set(seen) and not set(got) & set(done)
        for k in got:
            del ends[k]
        done += got
        if not pending and s.idle():
            break
    assert sorted(done) == sorted(f"r{i}" for i in range(rows))  # every row once
    assert s.pool == KvPool.empty(config.pool_tokens)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("schedule", ["alternate", "chunked"])
def test_every_row_ends_once_and_the_book_always_adds_up(seed: int, schedule: str) -> None:
    lanes = LanePolicy(reserved_slots=2, bulk_gap=2, bulk_prefill_tokens=512, extra_steps=1,
                       bulk_max_wait_s=64)
    config = SchedulerConfig(slots=8, pool_tokens=4096, max_new_tokens=64, schedule=schedule,
                             pass_tokens=1024, prefill_gap=2, packed=seed % 2 == 0, lanes=lanes)
    simulate(config, seed)


def test_no_admission_while_the_runner_has_a_pass_in_flight_but_drops_go_out() -> None:
    s = LoopScheduler(SchedulerConfig(slots=4, pool_tokens=2048, max_new_tokens=16))
    s.add([Request("a", 50), Request("b", 50)], 0.0)
    assert [a.key for a in s.schedule(0.0).admit] == ["a", "b"]
    s.add([Request("c", 50)], 0.0)
    s.drop({"a"})
    plan = s.schedule(0.0, prefill=False)  # one pass at a time: "c" waits for the next plan
    assert plan.admit == () and plan.drop == ("a",) and s.waiting == 1
    assert [a.key for a in tick(s).admit] == ["c"]


def test_a_rejected_add_queues_none_of_its_rows() -> None:
    s = LoopScheduler(SchedulerConfig(slots=2, pool_tokens=256, max_new_tokens=8))
    with pytest.raises(ValueError, match="over the pool"):
        s.add([Request("ok", 10), Request("big", 300)], 0.0)
    with pytest.raises(ValueError, match="in the loop already"):
        s.add([Request("x", 10), Request("x", 10)], 0.0)
    assert s.waiting == 0 and s.waiting_keys() == [] and s.idle()


def test_clear_forgets_every_row_and_gives_the_pool_back() -> None:
    s = LoopScheduler(SchedulerConfig(slots=1, pool_tokens=512, max_new_tokens=8))
    s.add([Request("a", 100), Request("b", 100)], 0.0)
    s.schedule(0.0)
    s.update(StepOutput(3))
    assert s.clear() == ["a", "b"]  # running first, then waiting
    assert s.idle() and s.pool == KvPool.empty(512) and s.step == 3  # the clock goes on
    s.add([Request("a", 100)], 0.0)
    assert [a.key for a in s.schedule(0.0).admit] == ["a"]


def test_the_plan_says_when_the_lane_was_busy_and_when_it_held_bulk_back() -> None:
    lanes = LanePolicy(reserved_slots=1, bulk_rows=1)
    s = LoopScheduler(SchedulerConfig(slots=4, pool_tokens=4096, max_new_tokens=8,
                                      lanes=lanes))
    s.add([Request("b0", 20), Request("b1", 20)], 0.0)
    plan = s.schedule(0.0)
    assert [a.key for a in plan.admit] == ["b0", "b1"] and not plan.busy
    assert not plan.bulk_held
    s.add([Request("b2", 20), Request("i", 20, interactive=True)], 0.0)
    plan = tick(s)
    assert [a.key for a in plan.admit] == ["i"] and plan.busy and plan.bulk_held
    assert s.waiting_keys() == ["b2"]


@pytest.mark.parametrize("max_wait_s", [5.0, math.inf])
def test_a_bulk_row_waiting_past_bulk_max_wait_s_goes_before_later_interactive_rows(
    max_wait_s: float,
) -> None:
    """No starvation (OCRQ_BULK_MAX_WAIT_S, the batcher's rule too: ocrq/core/lanes.py): the
    pool holds one row at a time and interactive rows keep coming; each passes the bulk row
    while it is young, but once it has waited `bulk_max_wait_s` (the time is the caller's: no
    clock) it ranks with them by arrival and takes the next range. Without promotion (an
    infinite wait) the same stream passes it for ever, so the check can fail."""
    lanes = LanePolicy(bulk_max_wait_s=max_wait_s)
    s = LoopScheduler(SchedulerConfig(slots=4, pool_tokens=200, max_new_tokens=8, lanes=lanes))
    assert capacity_of(100, 8) * 2 > 200  # one row in the pool at a time
    s.add([Request("i0", 100, interactive=True)], 0.0)
    assert [a.key for a in s.schedule(0.0).admit] == ["i0"]
    s.add([Request("old", 100)], 1.0)
    assert tick(s, now=1.0).admit == ()  # no range: it waits
    s.add([Request("i1", 100, interactive=True)], 2.0)
    assert [a.key for a in tick(s, ("i0",), now=2.0).admit] == ["i1"]  # young: passed
    s.add([Request("i2", 100, interactive=True)], 5.9)
    assert [a.key for a in tick(s, ("i1",), now=5.9).admit] == ["i2"]  # 4.9 s: still passed
    s.add([Request("i3", 100, interactive=True)], 6.5)
    plan = tick(s, ("i2",), now=6.5)  # "old" has waited 5.5 s
    if max_wait_s == math.inf:
        assert [a.key for a in plan.admit] == ["i3"] and s.waiting_keys() == ["old"]
    else:
        assert [a.key for a in plan.admit] == ["old"] and s.waiting_keys() == ["i3"]


def test_a_promoted_bulk_row_is_no_longer_held_by_the_lane_s_limits() -> None:
    """While an interactive row is live the lane holds bulk rows to one pass every `bulk_gap`
    steps; a bulk row past `bulk_max_wait_s` is exempt from that, as from the budget and cap."""
    lanes = LanePolicy(bulk_gap=1000, bulk_max_wait_s=10.0)
    s = LoopScheduler(SchedulerConfig(slots=4, pool_tokens=4096, max_new_tokens=8,
                                      lanes=lanes))
    s.add([Request("b0", 20), Request("i", 20, interactive=True)], 0.0)
    assert [a.key for a in s.schedule(0.0).admit] == ["i", "b0"]  # a bulk pass: the gap starts
    s.add([Request("b1", 20)], 0.0)
    assert tick(s, now=9.0).admit == () and s.waiting_keys() == ["b1"]  # held by the gap
    plan = tick(s, now=10.0)
    assert [a.key for a in plan.admit] == ["b1"] and plan.busy


def test_the_scheduler_imports_no_torch() -> None:
    code = ("import sys, ocrq.models.loop; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
