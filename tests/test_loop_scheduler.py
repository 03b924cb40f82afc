"""The running loop's scheduler (ocrq/models/loop/) on the CPU, no torch: ticks of
`schedule -> StepOutput -> update` driven by a runner simulated here, as vLLM v1's scheduler
tests drive theirs. (It took the place of the Hunyuan loop's own admission policy; until then a
test here checked, tick for tick, that both made the same plans.)"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from ocrq.models.loop import LoopScheduler, Request, SchedulerConfig, StepOutput, StepPlan
from ocrq.models.loop.lane_pass import LanePolicy
from ocrq.models.slots import KvPool, capacity_of


def tick(s: LoopScheduler, finished: tuple[str, ...] = (), steps: int = 1) -> StepPlan:
    s.update(StepOutput(steps, finished))
    return s.schedule()


def test_a_row_is_admitted_into_a_slot_and_range_and_handed_back_once() -> None:
    s = LoopScheduler(SchedulerConfig(slots=2, pool_tokens=1024, max_new_tokens=32))
    s.add([Request("a", 100), Request("b", 50, max_new_tokens=4), Request("c", 80)])
    plan = s.schedule()
    assert [(a.key, a.slot, a.start) for a in plan.admit] == [("a", 0, 0), ("b", 1, 144)]
    assert [a.capacity for a in plan.admit] == [capacity_of(100, 32), capacity_of(50, 4)]
    assert [a.row_cap for a in plan.admit] == [32, 4]
    assert plan.blocked == "no free slot" and plan.decode_steps == 1  # "c" waits: ask again
    assert s.pool.free_tokens == 1024 - 144 - 64
    assert s.update(StepOutput(4, ("b",))) == ("b",)
    assert s.update(StepOutput(0, ("b",))) == ()  # a late copy names it again: not twice
    plan = s.schedule()
    assert [(a.key, a.slot) for a in plan.admit] == [("c", 1)]  # the freed slot
    assert plan.decode_steps == s.config.check_every  # nothing waits
    assert s.update(StepOutput(3, ("a", "c"))) == ("a", "c")
    assert s.idle() and s.pool == KvPool.empty(1024) and s.step == 7


def test_rows_the_loop_cannot_take_are_refused_when_queued() -> None:
    s = LoopScheduler(SchedulerConfig(slots=2, pool_tokens=256, max_new_tokens=32))
    with pytest.raises(ValueError, match="over the pool"):
        s.add([Request("big", 300)])
    with pytest.raises(ValueError, match="outside"):
        s.add([Request("x", 10, max_new_tokens=33)])
    s.add([Request("a", 10)])
    with pytest.raises(ValueError, match="in the loop already"):
        s.add([Request("a", 10)])


def test_a_dropped_row_frees_its_slot_for_the_same_plan_and_never_comes_back() -> None:
    s = LoopScheduler(SchedulerConfig(slots=1, pool_tokens=512, max_new_tokens=8))
    s.add([Request("a", 100), Request("b", 100), Request("c", 100)])
    assert [a.key for a in s.schedule().admit] == ["a"]
    assert s.drop({"a", "b"}) == ["b", "a"]  # waiting "b" at once, running "a" as well
    plan = s.schedule()
    assert plan.drop == ("a",) and [(a.key, a.slot) for a in plan.admit] == [("c", 0)]
    assert s.update(StepOutput(1, ("a", "c"))) == ("c",)  # "a" was dropped, not finished
    assert s.schedule().drop == () and s.idle()


def test_chunked_passes_wait_for_the_gap_unless_an_interactive_row_waits() -> None:
    s = LoopScheduler(SchedulerConfig(slots=8, pool_tokens=4096, max_new_tokens=16,
                                      prefill_gap=4))
    s.add([Request("a", 50)])
    assert len(s.schedule().admit) == 1
    s.add([Request("b", 50)])
    for _ in range(3):
        assert tick(s).admit == ()  # rows decode meanwhile: fewer, fuller passes
    assert [a.key for a in tick(s).admit] == ["b"]
    s.add([Request("c", 50), Request("i", 50, interactive=True)])
    assert [a.key for a in tick(s).admit] == ["i", "c"]  # at once, and first


def test_with_interactive_only_steps_the_reserve_is_the_lowest_slots() -> None:
    """Bulk rows take slots above the reserve, an interactive row the lowest reserved one, where
    the runner's interactive-only step over the first slots covers it (which slots that step
    covers is the runner's: it follows the rows live on the device)."""
    lanes = LanePolicy(reserved_slots=2, extra_steps=2)
    s = LoopScheduler(SchedulerConfig(slots=40, pool_tokens=1 << 16, max_new_tokens=16,
                                      lanes=lanes))
    s.add([Request(f"b{i}", 20) for i in range(20)])
    plan = s.schedule()
    assert {a.slot for a in plan.admit} == set(range(2, 22))
    s.add([Request("i", 20, interactive=True)])
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
            s.add(batch)
        plan = s.schedule()
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
                       promote_steps=64)
    config = SchedulerConfig(slots=8, pool_tokens=4096, max_new_tokens=64, schedule=schedule,
                             pass_tokens=1024, prefill_gap=2, packed=seed % 2 == 0, lanes=lanes)
    simulate(config, seed)


def test_no_admission_while_the_runner_has_a_pass_in_flight_but_drops_go_out() -> None:
    s = LoopScheduler(SchedulerConfig(slots=4, pool_tokens=2048, max_new_tokens=16))
    s.add([Request("a", 50), Request("b", 50)])
    assert [a.key for a in s.schedule().admit] == ["a", "b"]
    s.add([Request("c", 50)])
    s.drop({"a"})
    plan = s.schedule(prefill=False)  # one pass at a time: "c" waits for the next plan
    assert plan.admit == () and plan.drop == ("a",) and s.waiting == 1
    assert [a.key for a in tick(s).admit] == ["c"]


def test_a_rejected_add_queues_none_of_its_rows() -> None:
    s = LoopScheduler(SchedulerConfig(slots=2, pool_tokens=256, max_new_tokens=8))
    with pytest.raises(ValueError, match="over the pool"):
        s.add([Request("ok", 10), Request("big", 300)])
    with pytest.raises(ValueError, match="in the loop already"):
        s.add([Request("x", 10), Request("x", 10)])
    assert s.waiting == 0 and s.waiting_keys() == [] and s.idle()


def test_clear_forgets_every_row_and_gives_the_pool_back() -> None:
    s = LoopScheduler(SchedulerConfig(slots=1, pool_tokens=512, max_new_tokens=8))
    s.add([Request("a", 100), Request("b", 100)])
    s.schedule()
    s.update(StepOutput(3))
    assert s.clear() == ["a", "b"]  # running first, then waiting
    assert s.idle() and s.pool == KvPool.empty(512) and s.step == 3  # the clock goes on
    s.add([Request("a", 100)])
    assert [a.key for a in s.schedule().admit] == ["a"]


def test_the_plan_says_when_the_lane_was_busy_and_when_it_held_bulk_back() -> None:
    lanes = LanePolicy(reserved_slots=1, bulk_rows=1)
    s = LoopScheduler(SchedulerConfig(slots=4, pool_tokens=4096, max_new_tokens=8,
                                      lanes=lanes))
    s.add([Request("b0", 20), Request("b1", 20)])
    plan = s.schedule()
    assert [a.key for a in plan.admit] == ["b0", "b1"] and not plan.busy
    assert not plan.bulk_held
    s.add([Request("b2", 20), Request("i", 20, interactive=True)])
    plan = tick(s)
    assert [a.key for a in plan.admit] == ["i"] and plan.busy and plan.bulk_held
    assert s.waiting_keys() == ["b2"]


def test_the_scheduler_imports_no_torch() -> None:
    code = ("import sys, ocrq.models.loop; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
