"""Planner properties: never over budget by the model, each item placed once, oldest first;
an image over the budget alone is shrunk to a size the model says fits, or refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ocrq.models.costs import CostModel, ItemCost
from ocrq.scheduling.planner import (
    Downscale,
    Refusal,
    ShrinkRule,
    Waiting,
    after_oom,
    plan,
    shrink_to_fit,
)

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


# -- downscaling -------------------------------------------------------------------------------

PIXEL_MODEL = CostModel(fixed_bytes=0, per_patch_bytes=1.0)  # a byte per pixel above a constant


class Sizes:
    """estimate_at of images whose cost is `base` + their pixels; records every size asked."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.asked: list[int] = []

    def __call__(self, key: str, pixels: int) -> ItemCost:
        self.asked.append(pixels)
        return ItemCost(tokens=1, patches=self.base + pixels, pixels=pixels)


def big(pixels: int, base: int = 0, key: str = "big", seq: int = 0) -> Waiting:
    return Waiting(key, ItemCost(1, base + pixels, pixels), seq=seq, pixels=pixels)


@given(
    st.integers(1, 50_000_000),
    st.integers(0, 100_000),
    st.integers(1, 10_000_000),
    st.builds(ShrinkRule, min_pixels=st.integers(1, 100_000), max_steps=st.integers(1, 20)),
)
@settings(max_examples=400, deadline=None)
def test_oversize_leader_is_shrunk_to_the_largest_halving_that_fits(
    pixels: int, base: int, budget: int, rule: ShrinkRule
) -> None:
    leader = big(pixels, base)
    others = [Waiting(f"s{i}", ItemCost(1, 1, 1), seq=i + 1) for i in range(3)]
    sizes = Sizes(base)
    p = plan([leader, *others], budget, PIXEL_MODEL, 8, sizes, rule)
    if base + pixels <= budget:
        assert p.keys[0] == "big" and not p.oversize and not sizes.asked
        return
    assert p.keys == () and p.oversize == ("big",) and p.deferred == ("s0", "s1", "s2")
    asked = sizes.asked
    # Halving from the present size, at most max_steps times, never below half the floor.
    assert asked == [pixels >> (i + 1) for i in range(len(asked))]
    assert len(asked) <= rule.max_steps
    assert asked or pixels <= rule.min_pixels  # an image at the floor is not shrunk at all
    assert all(a >= rule.min_pixels // 2 for a in asked)
    assert all(base + a > budget for a in asked[:-1])  # each earlier size was still too big
    if p.downscale:
        (d,) = p.downscale
        assert d.pixels == asked[-1] < pixels
        assert PIXEL_MODEL.batch_bytes([d.cost]) <= budget
        assert d.cost == sizes("big", d.pixels)
    else:
        assert len(p.refused) == 1
        last = asked[-1] if asked else pixels
        assert base + last > budget
        # Refused only when no halving is left.
        assert len(asked) == rule.max_steps or last <= rule.min_pixels


def test_a_cost_that_does_not_shrink_is_refused_at_once() -> None:
    """An engine that upscales small images: a smaller image costs as much; stop asking."""
    flat = lambda key, pixels: ItemCost(1, 10_000, 10_000)  # noqa: E731
    fate = shrink_to_fit(big(10_000), 5_000, PIXEL_MODEL, flat)
    assert isinstance(fate, Refusal) and "costs no less" in fate.reason


def test_an_estimate_that_refuses_the_smaller_image_refuses_the_job() -> None:
    def thin(key: str, pixels: int) -> ItemCost:
        raise ValueError("aspect ratio 300 is too thin")

    fate = shrink_to_fit(big(10_000), 5_000, PIXEL_MODEL, thin)
    assert isinstance(fate, Refusal) and "too thin" in fate.reason


def test_without_a_size_search_an_oversize_leader_is_refused() -> None:
    p = plan([big(10_000)], 5_000, PIXEL_MODEL, 4)
    assert p.refused and p.refused[0].key == "big" and "alone" in p.refused[0].reason


def test_the_refusal_of_a_far_too_large_image_says_so() -> None:
    p = plan([big(400 * 400)], 1_000, PIXEL_MODEL, 4, Sizes())
    (r,) = p.refused
    assert "even at 2500 pixels" in r.reason


@given(st.lists(st.integers(1, 1_000_000), min_size=1, max_size=40), st.integers(1, 1 << 30))
@settings(max_examples=200, deadline=None)
def test_after_oom_halves_a_batch_and_shrinks_a_single_image(
    pixel_counts: list[int], retry_bytes: int
) -> None:
    failed = [big(p, key=f"k{i}", seq=i) for i, p in enumerate(pixel_counts)]
    decision = after_oom(failed, retry_bytes, PIXEL_MODEL, Sizes())
    if len(failed) > 1:
        first, second = decision.halves
        assert first and second and first + second == tuple(w.key for w in failed)
        assert abs(len(first) - len(second)) <= 1 and decision.retry is None
        return
    assert decision.halves is None
    retry = decision.retry
    if isinstance(retry, Downscale):
        assert retry.pixels < pixel_counts[0]
        assert PIXEL_MODEL.batch_bytes([retry.cost]) <= retry_bytes
    else:
        assert isinstance(retry, Refusal)


def test_after_oom_retries_smaller_even_when_the_budget_would_allow_it() -> None:
    """A single image that failed alone is retried below what failed: the failure proved the
    model wrong for it, whatever the budget says."""
    decision = after_oom([big(40_000)], 32_000, PIXEL_MODEL, Sizes())
    assert decision.retry == Downscale("big", 20_000, ItemCost(1, 20_000, 20_000))
    with pytest.raises(ValueError):
        after_oom([], 1, PIXEL_MODEL, Sizes())
