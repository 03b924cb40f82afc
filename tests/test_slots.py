"""The running loop's slot and KV accounting (ocrq/models/slots.py) and the planner's hand-over
(`fit_running`) and the loop's scheduler, driven by hypothesis without a device.

Properties: the rows in flight never hold more than the pool nor more slots than there are;
their ranges never overlap; admission is first in, first out; a pass's padded prompt stays within
its tokens unless it is one row; and once every row has finished, the pool is whole again and the
oldest waiting row is admitted (nothing starves). `RunningBudget` never plans past the budget.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ocrq.models.costs import CostModel, GiB, ItemCost
from ocrq.models.slots import (
    Candidate,
    KvPool,
    RunningBudget,
    admit,
    capacity_of,
)
from ocrq.scheduling.planner import Downscale, Refusal, Waiting, fit_running

KiB = 1024
row = st.tuples(st.integers(1, 3000), st.integers(1, 1100))  # prompt tokens, max new tokens
# An event: a new row arrives, or the live row at (index mod live) finishes.
event = st.one_of(st.tuples(st.just("arrive"), row), st.tuples(st.just("finish"), st.integers(0)))


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(event, min_size=1, max_size=80),
    slots=st.integers(1, 12),
    pool_tokens=st.integers(4200, 40_000),
    pass_tokens=st.integers(256, 20_000),
)
def test_admission_keeps_the_running_set_within_the_pool_and_slots(
    events: list, slots: int, pool_tokens: int, pass_tokens: int
) -> None:
    pool = KvPool.empty(pool_tokens // 16 * 16)
    waiting: list[Candidate] = []
    live: dict[str, tuple[int, int, int]] = {}  # key -> (slot, start, capacity)
    admitted_order: list[str] = []
    arrived_order: list[str] = []
    for i, (kind, arg) in enumerate(events):
        if kind == "arrive":
            prompt, new = arg
            cap = capacity_of(prompt, new)
            if cap > pool.size:
                continue  # the planner refuses or downscales these before the loop sees them
            waiting.append(Candidate(f"r{i}", prompt, cap))
            arrived_order.append(f"r{i}")
        elif live:
            key = sorted(live)[arg % len(live)]
            _, start, cap = live.pop(key)
            pool = pool.give(start, cap)
        free = [s for s in range(slots) if s not in {v[0] for v in live.values()}]
        was_empty, had_waiting = not live, bool(waiting)
        plan = admit(waiting, pool, free, pass_tokens)
        placed = plan.placements
        assert [p.key for p in placed] == [c.key for c in waiting[: len(placed)]]  # FIFO
        if len(placed) > 1:
            longest = max(c.prompt_tokens for c in waiting[: len(placed)])
            assert len(placed) * longest <= pass_tokens
        for p in placed:
            live[p.key] = (p.slot, p.start, p.capacity)
            admitted_order.append(p.key)
        waiting = waiting[len(placed) :]
        pool = plan.pool
        # Invariants of the running set.
        held = sum(cap for _, _, cap in live.values())
        assert held + pool.free_tokens == pool.size
        assert len(live) <= slots
        assert len({s for s, _, _ in live.values()}) == len(live)
        spans = sorted((start, start + cap) for _, start, cap in live.values())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(s >= 0 and e <= pool.size for s, e in spans)
        if was_empty and had_waiting:  # an empty loop always takes the oldest row
            assert placed
    assert admitted_order == arrived_order[: len(admitted_order)]
    # Drain: finishing every live row empties the pool and admits the waiting ones in order.
    while live or waiting:
        for key in list(live):
            _, start, cap = live.pop(key)
            pool = pool.give(start, cap)
        assert pool.free == ((0, pool.size),)
        plan = admit(waiting, pool, list(range(slots)), pass_tokens)
        assert plan.placements or not waiting  # the oldest row always fits an empty loop
        for p in plan.placements:
            live[p.key] = (p.slot, p.start, p.capacity)
        waiting = waiting[len(plan.placements) :]
        pool = plan.pool


def test_pool_ranges_merge_and_refuse_a_double_free() -> None:
    pool = KvPool.empty(100)
    a, pool = pool.take(30)
    b, pool = pool.take(30)
    c, pool = pool.take(30)
    assert (a, b, c) == (0, 30, 60) and pool.take(20) is None
    pool = pool.give(a, 30).give(c, 30)
    assert pool.take(50) is None  # 30 + 40 free, but apart: fragmentation
    pool = pool.give(b, 30)
    assert pool.free == ((0, 100),)
    try:
        pool.give(0, 10)
    except ValueError:
        pass
    else:
        raise AssertionError("freeing a free range must fail")


MODEL = CostModel(
    fixed_bytes=2 * GiB, per_token_bytes=139 * KiB, per_cache_token_bytes=100 * KiB,
    decode_fixed_bytes=42 * 1024 * KiB,
)


@settings(max_examples=200, deadline=None)
@given(
    budget_gib=st.floats(4, 120),
    slots=st.integers(1, 512),
    prefill=st.integers(256, 32768),
    state=st.integers(0, 2_000_000),
)
def test_running_budget_never_plans_past_the_budget(
    budget_gib: float, slots: int, prefill: int, state: int
) -> None:
    budget = int(budget_gib * GiB)
    try:
        running = RunningBudget.plan(
            MODEL, budget, slots=slots, prefill_tokens=prefill, state_bytes_per_slot=state
        )
    except ValueError:
        return  # nothing left for a pool: refused, never over-committed
    assert running.bytes <= budget
    assert running.pool_tokens * MODEL.per_cache_token_bytes <= running.pool_bytes + 1
    # Almost all of the budget is used: within one granule of KV.
    assert budget - running.bytes < 16 * MODEL.per_cache_token_bytes + 1


costs = st.builds(
    lambda p, n: ItemCost(tokens=p + n, patches=4 * p, pixels=0, new_tokens=n),
    st.integers(1, 4000),
    st.integers(1, 1100),
)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(costs, min_size=1, max_size=40), held=st.integers(0, 30_000))
def test_the_loop_admits_the_oldest_within_the_pool(items: list[ItemCost], held: int) -> None:
    """(Was the batcher's `plan_running`; the loop's scheduler holds the only KV book now.) With
    bulk rows only and slots to spare, one pass takes the oldest rows while their KV fits the
    pool beside `held` tokens already taken, and stops at the first that does not."""
    from ocrq.models.loop import LoopScheduler, Request, SchedulerConfig

    loop = RunningBudget.plan(MODEL, 12 * GiB, slots=64, prefill_tokens=16384)
    held = min(held, loop.pool_tokens - 16) // 16 * 16
    s = LoopScheduler(SchedulerConfig(64, loop.pool_tokens, 1100, pass_tokens=1 << 30,
                                      packed=True))
    s.pool = s.pool.take(held)[1] if held else s.pool  # type: ignore[index]
    fits = [c for c in items if capacity_of(c.prompt_tokens, c.new_tokens) <= loop.pool_tokens]
    s.add([Request(f"k{i}", c.prompt_tokens, c.new_tokens) for i, c in enumerate(fits)], 0.0)
    keys = [a.key for a in s.schedule(0.0).admit]
    assert keys == [f"k{i}" for i in range(len(keys))]
    taken = sum(capacity_of(c.prompt_tokens, c.new_tokens) for c in fits[: len(keys)])
    assert held + taken <= loop.pool_tokens
    if len(keys) < len(fits):  # the next oldest did not fit: that is why it stopped
        nxt = fits[len(keys)]
        assert held + taken + capacity_of(nxt.prompt_tokens, nxt.new_tokens) > loop.pool_tokens


def test_a_row_the_loop_can_never_hold_is_refused_or_downscaled_alone() -> None:
    """The batcher's one check per row (`fit_running`): None for a row that fits alone."""
    loop = RunningBudget(4, 1000, 512, 10**6, 10**6, 0, 0)
    huge = Waiting("big", ItemCost(tokens=5000, patches=0, pixels=0, new_tokens=10), 0)
    small = Waiting("small", ItemCost(tokens=100, patches=0, pixels=0, new_tokens=10), 1)
    assert fit_running(small, loop) is None
    fate = fit_running(huge, loop)
    assert isinstance(fate, Refusal) and fate.key == "big"  # no pixels: it cannot shrink
    shrinkable = Waiting("pic", huge.cost, 2, pixels=1 << 20)
    fate = fit_running(shrinkable, loop, lambda key, px: ItemCost(
        tokens=px // 2048, patches=0, pixels=px, new_tokens=10))
    assert isinstance(fate, Downscale) and loop.fits_alone(fate.cost, 10)
