"""Planner properties: never over budget by the model, each item placed once, oldest first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from models.costs import CostModel, ItemCost
from worker.planner import Waiting, plan

MODEL = CostModel(
    fixed_bytes=2 << 30, per_item_bytes=1e6, per_token_bytes=135 * 1024, per_patch_bytes=2e3
)

costs = st.builds(
    ItemCost,
    tokens=st.integers(1, 5000),
    patches=st.integers(0, 20000),
    pixels=st.integers(1, 4_000_000),
)
waitings = st.lists(costs, min_size=0, max_size=60).map(
    lambda cs: [Waiting(f"k{i}", c, seq=i) for i, c in enumerate(cs)]
)


@given(waitings, st.integers(1, 64 << 30), st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_plan_invariants(items: list[Waiting], budget: int, max_items: int) -> None:
    p = plan(items, budget, MODEL, max_items)
    by_key = {w.key: w for w in items}
    placed = list(p.keys) + list(p.deferred) + list(p.oversize)
    assert sorted(placed) == sorted(by_key)  # every item exactly once
    assert len(p.keys) <= max_items
    assert MODEL.batch_bytes([by_key[k].cost for k in p.keys]) == p.predicted_bytes <= budget
    if items:
        oldest = min(items, key=lambda w: w.seq).key
        assert oldest in p.keys or oldest in p.oversize  # nothing starves
        assert p.keys[:1] == (oldest,) or p.oversize == (oldest,)
    assert list(p.deferred) == sorted(p.deferred, key=lambda k: by_key[k].seq)


@given(waitings, st.integers(1, 64 << 30))
@settings(max_examples=200, deadline=None)
def test_oversize_only_when_leader_alone_does_not_fit(items: list[Waiting], budget: int) -> None:
    p = plan(items, budget, MODEL, 16)
    if p.oversize:
        leader = min(items, key=lambda w: w.seq)
        assert MODEL.batch_bytes([leader.cost]) > budget and p.keys == ()


def test_groups_similar_lengths_to_cut_padding() -> None:
    small = [Waiting(f"s{i}", ItemCost(100, 0, 1), seq=i) for i in range(1, 5)]
    big = [Waiting(f"b{i}", ItemCost(3000, 0, 1), seq=10 + i) for i in range(4)]
    leader = Waiting("lead", ItemCost(3000, 0, 1), seq=0)
    # Budget for exactly 4 sequences of 3000 tokens.
    budget = MODEL.batch_bytes([leader.cost] * 4)
    p = plan([leader, *small, *big], budget, MODEL, 32)
    assert p.keys[0] == "lead"
    assert set(p.keys[1:]) <= {w.key for w in big}  # big ones join the big leader
    assert len(p.keys) == 4


def test_budget_fills_and_defers() -> None:
    items = [Waiting(f"k{i}", ItemCost(1000, 100, 1), seq=i) for i in range(10)]
    one = MODEL.batch_bytes([items[0].cost])
    p = plan(items, int(one * 3.5), MODEL, 32)
    assert p.keys == ("k0", "k1", "k2") and p.deferred[0] == "k3"
