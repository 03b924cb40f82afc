"""The running loop's lane rule (ocrq/models/loop/lane_pass.py), driven by hypothesis without a
device.

Properties of one pass: placements follow the pass order and each lane keeps its arrival order;
bulk rows never take a reserved slot (neither more than their share nor one of the lowest
slots, which are the reserve), interactive rows take those first; an interactive row is placed
in the next pass however full of bulk rows the loop is; while the lane is busy, bulk rows keep
to the gap, the prompt budget and the live-row cap; with bulk rows only and no reserve, the
pass is `admit`'s. And over many passes, bulk never starves: in a simulated loop fed a
never-ending interactive stream (with the lane's limits at their tightest) every bulk row is
admitted within `bulk_max_wait_s` (OCRQ_BULK_MAX_WAIT_S: the simulated loop runs one decode step
a second, the time it hands the rule) plus a bounded number of row lifetimes; without promotion
the same stream does starve it, so that check can fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from ocrq.models.loop.lane_pass import (
    LanePolicy,
    LoopState,
    Waiter,
    lane_pass,
    pass_order,
    promoted,
)
from ocrq.models.slots import Candidate, KvPool, admit

waiters = st.lists(
    st.builds(
        Waiter,
        key=st.just(""),
        prompt_tokens=st.integers(1, 3000),
        capacity=st.integers(16, 4000),
        interactive=st.booleans(),
        queued_at=st.integers(0, 600).map(float),
    ),
    max_size=24,
).map(lambda ws: sorted(
    (replace(w, key=f"r{i}") for i, w in enumerate(ws)), key=lambda w: w.queued_at
))
policies = st.builds(
    LanePolicy,
    reserved_slots=st.integers(0, 4),
    bulk_prefill_tokens=st.sampled_from([0, 512, 2048, 8192]),
    bulk_gap=st.integers(1, 8),
    bulk_rows=st.sampled_from([0, 1, 4, 16]),
    bulk_max_wait_s=st.sampled_from([0.0, 64.0, 256.0, math.inf]),
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[Waiter], KvPool, LoopState, LanePolicy, int, bool]:
    policy = draw(policies)
    slots = draw(st.integers(policy.reserved_slots + 1, 32))
    live_bulk = draw(st.integers(0, slots - policy.reserved_slots))
    live_interactive = draw(st.integers(0, slots - live_bulk))
    live = live_bulk + live_interactive
    free = tuple(sorted(draw(st.permutations(range(slots)))[: slots - live]))
    step = draw(st.integers(0, 700))
    state = LoopState(slots, free, live_bulk, live_interactive, step,
                      step - draw(st.integers(0, 10)), float(step))  # a step a second
    pool = KvPool.empty(draw(st.integers(4000, 40000)))
    return draw(waiters), pool, state, policy, draw(st.integers(3000, 16384)), draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(cases())
def test_placements_follow_the_pass_order_and_each_lane_its_arrival(case: tuple) -> None:
    waiting, pool, state, policy, tokens, packed = case
    decided = lane_pass(waiting, pool, state, tokens, policy, packed=packed)
    order = [w.key for w in pass_order(waiting, state.now, policy)]
    keys = [p.key for p in decided.placements]
    assert keys == [k for k in order if k in set(keys)]
    by_key = {w.key: w for w in waiting}
    arrival = {w.key: i for i, w in enumerate(waiting)}
    for lane in (True, False):
        mine = [arrival[k] for k in keys if by_key[k].interactive is lane]
        assert mine == sorted(mine)
    # Bulk rows are taken oldest first: none placed while an older (unpromoted) one waits.
    bulk_left = [arrival[w.key] for w in waiting if not w.interactive and w.key not in keys]
    for k in keys:
        if not by_key[k].interactive:
            assert all(arrival[k] < i for i in bulk_left), (k, bulk_left)
    # Slots are free ones, ranges are in the pool and do not overlap.
    assert {p.slot for p in decided.placements} <= set(state.free_slots)
    assert len({p.slot for p in decided.placements}) == len(keys)
    spans = sorted((p.start, p.start + p.capacity) for p in decided.placements)
    assert all(a[1] <= b[0] for a, b in pairwise(spans))
    assert all(end <= pool.size for _, end in spans)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_bulk_never_takes_a_reserved_slot(case: tuple) -> None:
    waiting, pool, state, policy, tokens, packed = case
    decided = lane_pass(waiting, pool, state, tokens, policy, packed=packed)
    by_key = {w.key: w for w in waiting}
    bulk = sum(not by_key[p.key].interactive for p in decided.placements)
    assert state.live_bulk + bulk <= max(state.slots - policy.reserved_slots, state.live_bulk)


@settings(max_examples=400, deadline=None)
@given(cases(), st.sampled_from([0, 2]))
def test_reserved_slots_are_the_lowest_and_interactive_rows_take_them_first(
    case: tuple, extra_steps: int
) -> None:
    """With interactive-only steps, no bulk row is placed in a slot below the reserve; each row
    takes the lowest slot still free that its lane may take, so an interactive row takes a
    reserved slot while one is free (where a small step over the first slots covers it).
    Without, every row takes the lowest free slot, as before the setting."""
    waiting, pool, state, policy, tokens, packed = case
    policy = replace(policy, extra_steps=extra_steps)
    decided = lane_pass(waiting, pool, state, tokens, policy, packed=packed)
    by_key = {w.key: w for w in waiting}
    reserve = policy.reserved_slots if extra_steps else 0
    left = sorted(state.free_slots)
    for p in decided.placements:
        interactive = by_key[p.key].interactive
        if not interactive:
            assert p.slot >= reserve
        else:
            assert p.slot < reserve or not any(s < reserve for s in left)
        assert p.slot == min(s for s in left if interactive or s >= reserve)
        left.remove(p.slot)


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(1, 3000), st.integers(0, 20))
def test_an_interactive_row_goes_in_the_next_pass_when_bulk_fills_the_loop(
    case: tuple, prompt: int, bulk_ahead: int
) -> None:
    """The loop's bulk slots all held, bulk rows queued ahead of it: an interactive row that fits
    the pool and the pass is placed, first unless promoted rows are older."""
    _, _, state, policy, tokens, packed = case
    policy = replace(policy, reserved_slots=max(policy.reserved_slots, 1))
    slots = max(state.slots, policy.reserved_slots + 1)
    live_bulk = slots - policy.reserved_slots
    free = tuple(range(live_bulk, slots))
    state = LoopState(slots, free, live_bulk, 0, state.step, state.last_bulk_pass, state.now)
    ahead = [Waiter(f"b{i}", 1000, 2000, False, state.now) for i in range(bulk_ahead)]
    row = Waiter("i", min(prompt, tokens), 1000, True, state.now)
    decided = lane_pass([*ahead, row], KvPool.empty(4000), state, tokens, policy, packed=packed)
    assert [p.key for p in decided.placements] == ["i"]
    assert decided.busy


@settings(max_examples=200, deadline=None)
@given(cases())
def test_while_busy_bulk_keeps_to_the_gap_the_budget_and_the_cap(case: tuple) -> None:
    waiting, pool, state, policy, tokens, packed = case
    decided = lane_pass(waiting, pool, state, tokens, policy, packed=packed)
    by_key = {w.key: w for w in waiting}
    held = [by_key[p.key] for p in decided.placements
            if not by_key[p.key].interactive and not promoted(by_key[p.key], state.now, policy)]
    busy = state.live_interactive > 0 or any(w.interactive for w in waiting)
    assert decided.busy == busy
    if not busy or not held:
        return
    assert state.step - state.last_bulk_pass >= policy.bulk_gap
    if policy.bulk_prefill_tokens and len(held) > 1:
        assert sum(w.prompt_tokens for w in held) <= policy.bulk_prefill_tokens
    if policy.bulk_rows:  # promoted rows come first in a pass and count against the cap
        bulk = sum(not by_key[p.key].interactive for p in decided.placements)
        assert state.live_bulk + bulk <= policy.bulk_rows


@settings(max_examples=300, deadline=None)
@given(cases())
def test_with_bulk_rows_only_and_no_reserve_the_pass_is_admits(case: tuple) -> None:
    waiting, pool, state, policy, tokens, packed = case
    waiting = [replace(w, interactive=False) for w in waiting]
    state = replace(state, live_bulk=state.live_bulk + state.live_interactive,
                    live_interactive=0)
    policy = replace(policy, reserved_slots=0)
    decided = lane_pass(waiting, pool, state, tokens, policy, packed=packed)
    plain = admit([Candidate(w.key, w.prompt_tokens, w.capacity) for w in waiting], pool,
                  state.free_slots, tokens, packed=packed)
    assert decided.placements == plain.placements
    assert decided.admission.pool == plain.pool
    assert not decided.busy and not decided.held


# -- no starvation, over many passes ----------------------------------------------------------

@dataclass
class Sim:
    """A loop of `slots` slots and a pool, a pass before every decode step, each row ending
    `length` steps after its prefill; rows reach it as the streaming batcher hands them over:
    every row at once, the step it arrives (ocrq/scheduling/streaming.py; the loop's scheduler
    holds the only queue)."""

    slots: int
    pool: KvPool
    policy: LanePolicy
    step: int = 0
    last_bulk: int = -(10**9)

    def __post_init__(self) -> None:
        self.outer: list[Waiter] = []
        self.waiting: list[Waiter] = []
        self.live: dict[int, tuple[Waiter, int, int]] = {}  # slot -> (row, start, end step)
        self.handed: dict[str, int] = {}
        self.admitted: dict[str, int] = {}

    def hand_over(self) -> None:
        for w in self.outer:
            self.handed[w.key] = self.step
            self.waiting.append(replace(w, queued_at=float(self.step)))
        self.outer = []

    def run_step(self, lengths: dict[str, int]) -> None:
        self.hand_over()
        live_i = sum(w.interactive for w, _, _ in self.live.values())
        free = tuple(s for s in range(self.slots) if s not in self.live)
        state = LoopState(self.slots, free, len(self.live) - live_i, live_i, self.step,
                          self.last_bulk, float(self.step))  # one decode step a second
        decided = lane_pass(self.waiting, self.pool, state, 4096, self.policy, packed=True)
        by_key = {w.key: w for w in self.waiting}
        for p in decided.placements:
            w = by_key.pop(p.key)
            self.live[p.slot] = (w, p.start, self.step + lengths[w.key])
            self.admitted[w.key] = self.step
            if not w.interactive:
                self.last_bulk = self.step
        self.pool = decided.admission.pool
        self.waiting = [w for w in self.waiting if w.key in by_key]
        self.step += 1
        for slot, (w, start, end) in list(self.live.items()):
            if end <= self.step:
                self.pool = self.pool.give(start, w.capacity)
                del self.live[slot]


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[int, int, int, int]], int]:
    slots = draw(st.integers(2, 8))
    reserved = draw(st.integers(0, slots - 1))
    longest = draw(st.integers(1, 12))
    bulk = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, longest),
                                   st.integers(16, 1000), st.integers(1, 2000)),
                         min_size=1, max_size=10))
    every = draw(st.integers(1, 3))  # an interactive row arrives every `every` steps, for ever
    return slots, reserved, longest, bulk, every


def loop_bound(ahead: int, longest: int, max_wait_s: float) -> int:
    """Decode steps a bulk row may wait in the loop (one a second): until promoted, then one
    bulk gap (8 here),
    then at most two lifetimes of the longest row (a bulk slot, then a pool range) for itself
    and for each of the `ahead` rows queued before it (the batcher hands every row over at
    once, so those are the rows that arrived before it: a set that only shrinks)."""
    return int(max_wait_s) + 8 + (ahead + 1) * 2 * (longest + 1)


def simulate(case: tuple, max_wait_s: float, horizon: int) -> tuple[Sim, list[str]]:
    slots, reserved, longest, bulk, every = case
    # The tightest lane: one bulk row a pass, a pass every 8 steps, one live bulk row.
    policy = LanePolicy(reserved, bulk_prefill_tokens=1, bulk_gap=8, bulk_rows=1,
                        bulk_max_wait_s=max_wait_s)
    sim = Sim(slots, KvPool.empty(2000), policy)
    lengths: dict[str, int] = {}
    arrivals: dict[int, list[Waiter]] = {}
    for i, (at, length, capacity, prompt) in enumerate(bulk):
        w = Waiter(f"b{i}", prompt, capacity, False, float(at))
        arrivals.setdefault(at, []).append(w)
        lengths[w.key] = length
    keys = [f"b{i}" for i in range(len(bulk))]
    n = 0
    while sim.step < horizon and not all(k in sim.admitted for k in keys):
        if sim.step % every == 0:  # each holds half the pool
            w = Waiter(f"i{n}", 100, 1000, True, float(sim.step))
            arrivals.setdefault(sim.step, []).append(w)
            lengths[w.key], n = longest, n + 1
        sim.outer += arrivals.get(sim.step, [])
        sim.run_step(lengths)
    return sim, keys


@settings(max_examples=120, deadline=None)
@given(streams(), st.sampled_from([0.0, 8.0, 32.0]))
def test_bulk_never_starves_under_an_endless_interactive_stream(
    case: tuple, max_wait_s: float
) -> None:
    """Once promoted, a bulk row is passed by no younger row in the loop, so its wait there is
    bounded (`loop_bound`), with the lane's limits at their tightest."""
    _, _, longest, bulk, every = case
    ahead = 40 // every + 1 + len(bulk)  # interactive rows before the last bulk one, and bulk
    bound = loop_bound(ahead, longest, max_wait_s)
    sim, keys = simulate(case, max_wait_s, 40 + bound)
    for key in keys:
        assert key in sim.admitted, (key, sim.step, sim.waiting, sim.outer[:3])
        waited = sim.admitted[key] - sim.handed[key]
        assert waited <= bound, (key, waited, bound)


def test_without_promotion_the_same_stream_starves_bulk() -> None:
    """The check above can fail: an interactive row every step, each holding half the pool,
    and no promotion in the loop: the bulk row, handed over, never finds a range."""
    case = (4, 1, 6, [(0, 3, 1500, 100)], 1)
    sim, keys = simulate(case, math.inf, 600)
    assert keys[0] in sim.handed and keys[0] not in sim.admitted
    sim, keys = simulate(case, 8.0, 600)
    assert sim.admitted[keys[0]] - sim.handed[keys[0]] <= loop_bound(2, 6, 8.0)
