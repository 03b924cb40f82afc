"""The admission order of the two lanes (ocrq/core/lanes.py `LaneRule`), driven by hypothesis
without a device, for the static planner (`plan`) and the order in which the streaming batcher
hands every row to a running loop (whose queue keeps to the same rule and bound:
tests/test_lane_pass.py and tests/test_loop_scheduler.py).

Properties: interactive first (the interactive part of a plan is the plan of the interactive
rows alone, and no bulk row is taken while an interactive row the loop could hold waits); first
in, first out within a lane; and bulk never starves: under an endless interactive stream that
alone would fill every plan, each bulk row is admitted within `bulk_max_wait_s` plus one plan
per row older than it. The same stream with no promotion (an infinite wait) does starve bulk,
so the starvation bound can fail.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ocrq.core.lanes import LaneRule
from ocrq.models.costs import CostModel, GiB, ItemCost
from ocrq.scheduling.planner import Plan, Waiting, admission_order, plan

MODEL = CostModel(
    fixed_bytes=2 << 30,
    per_item_bytes=1e6,
    per_token_bytes=135 * 1024,
    per_patch_bytes=2e3,
    per_cache_token_bytes=100 * 1024,
    decode_fixed_bytes=42 << 20,
)
NO_PROMOTION = LaneRule(bulk_max_wait_s=math.inf)

costs = st.builds(
    ItemCost,
    tokens=st.integers(1, 5000),
    patches=st.integers(0, 20000),
    pixels=st.integers(1, 4_000_000),
    new_tokens=st.integers(1, 1024),
)
rows = st.lists(st.tuples(costs, st.booleans()), min_size=0, max_size=50).map(
    lambda cs: [
        Waiting(f"k{i}", c, seq=i, lane="interactive" if live else "bulk")
        for i, (c, live) in enumerate(cs)
    ]
)


def _lane(items: list[Waiting], lane: str) -> list[Waiting]:
    return [w for w in items if w.lane == lane]


def _fifo_within_lanes(p: Plan, items: list[Waiting]) -> None:
    """Within a lane the rows taken are the oldest of that lane (running loop: a prefix)."""
    by_key = {w.key: w for w in items}
    for lane in ("interactive", "bulk"):
        taken = [by_key[k].seq for k in p.keys if by_key[k].lane == lane]
        left = [w.seq for w in _lane(items, lane) if w.key not in p.keys]
        if taken and left:
            assert max(taken) < min(left)


@given(rows, st.integers(1, 64 << 30), st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_static_plan_admits_interactive_rows_first(
    items: list[Waiting], budget: int, max_items: int
) -> None:
    p = plan(items, budget, MODEL, max_items, lanes=NO_PROMOTION)
    alone = plan(_lane(items, "interactive"), budget, MODEL, max_items, lanes=NO_PROMOTION)
    live = {w.key for w in _lane(items, "interactive")}
    assert [k for k in p.keys if k in live] == list(alone.keys)
    assert [k for k in p.oversize if k in live] == list(alone.oversize)
    if live and (p.keys or p.oversize):  # the batch is led by the oldest interactive row
        first = min(_lane(items, "interactive"), key=lambda w: w.seq).key
        assert (p.keys[:1] or p.oversize[:1]) == (first,)
    order = [w.key for w in admission_order(items, NO_PROMOTION)]
    assert list(p.deferred) == [k for k in order if k in p.deferred]


@given(rows, st.integers(1, 64 << 30), st.floats(0, 5), st.floats(0, 60))
@settings(max_examples=200, deadline=None)
def test_without_interactive_rows_the_plans_are_the_first_in_first_out_ones(
    items: list[Waiting], budget: int, step_s: float, max_wait_s: float
) -> None:
    """All bulk, some of it promoted (older rows waited longer): the plans are those of before
    lanes existed, i.e. with no promotion at all."""
    n = len(items)
    bulk = [Waiting(w.key, w.cost, w.seq, waited_s=(n - w.seq) * step_s) for w in items]
    rule = LaneRule(bulk_max_wait_s=max_wait_s)
    assert plan(bulk, budget, MODEL, 16, lanes=rule) == plan(
        bulk, budget, MODEL, 16, lanes=NO_PROMOTION
    )
    # What the streaming batcher hands its loop: every row, in that order, oldest first.
    assert admission_order(bulk, rule) == sorted(bulk, key=lambda w: w.seq)


def _simulate(
    bulk: list[ItemCost],
    stream: list[ItemCost],
    per_step: int,
    rule: LaneRule,
    steps: int,
    dt_s: float = 1.0,
) -> dict[str, int]:
    """Bulk rows waiting at step 0, then `per_step` interactive rows arriving every step (the
    stream cycles through `stream`); each step plans once, and what was admitted the step
    before has finished (the loop is empty again). Returns each bulk row's admission step."""
    waiting: dict[str, tuple[Waiting, float]] = {}
    seq = 0
    for c in bulk:
        waiting[f"b{seq}"] = (Waiting(f"b{seq}", c, seq, lane="bulk"), 0.0)
        seq += 1
    admitted: dict[str, int] = {}
    for step in range(steps):
        now = step * dt_s
        for j in range(per_step):
            key = f"i{seq}"
            cost = stream[(seq + j) % len(stream)]
            waiting[key] = (Waiting(key, cost, seq, lane="interactive"), now)
            seq += 1
        items = [
            Waiting(w.key, w.cost, w.seq, lane=w.lane, waited_s=now - since)
            for w, since in waiting.values()
        ]
        p = plan(items, 4 * GiB, MODEL, 8, lanes=rule)
        assert p.keys, "every plan admits its leader (each row fits alone)"
        for key in p.keys:
            del waiting[key]
            if key.startswith("b"):
                admitted[key] = step
    return admitted


fitting = st.builds(
    ItemCost,
    tokens=st.integers(1, 3000),
    patches=st.integers(0, 2000),
    pixels=st.integers(1, 1_000_000),
    new_tokens=st.integers(1, 1024),
)


@given(
    bulk=st.lists(fitting, min_size=1, max_size=12),
    stream=st.lists(fitting, min_size=1, max_size=8),
    wait_steps=st.integers(0, 6),
)
@settings(max_examples=150, deadline=None)
def test_bulk_never_starves_under_an_endless_interactive_stream(
    bulk: list[ItemCost], stream: list[ItemCost], wait_steps: int
) -> None:
    # More interactive rows arrive each step than any plan can take (a static batch holds at
    # most 8): without promotion bulk would wait forever. (The running loop's own bound is
    # tests/test_lane_pass.py's.)
    rule = LaneRule(bulk_max_wait_s=float(wait_steps))
    steps = wait_steps + len(bulk) + 2
    admitted = _simulate(bulk, stream, 9, rule, steps)
    for i in range(len(bulk)):
        # promoted at step `wait_steps`; then ahead of it only rows older than it: the bulk
        # rows before it (the interactive ones all arrived later), one plan each at most.
        assert admitted.get(f"b{i}", steps) <= wait_steps + i, admitted


def test_without_promotion_the_stream_starves_bulk() -> None:
    """The bound above can fail: with no promotion, a saturating stream admits no bulk row."""
    row = ItemCost(tokens=1000, patches=100, pixels=10_000, new_tokens=256)
    admitted = _simulate([row] * 3, [row], 9, NO_PROMOTION, 30)
    assert admitted == {}
    promoted = _simulate([row] * 3, [row], 9, LaneRule(5.0), 30)
    assert set(promoted) == {"b0", "b1", "b2"}
