"""The budget governor: OOM backoff, floor and recovery, driven as plain values (no threads)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ocrq.scheduling.governor import BudgetGovernor

# An event is ("oom", predicted bytes) or ("batch", OOMs during it).
events = st.lists(
    st.one_of(
        st.tuples(st.just("oom"), st.integers(0, 1 << 40)),
        st.tuples(st.just("batch"), st.integers(0, 3)),
    ),
    max_size=200,
)
policies = st.fixed_dictionaries(
    {
        "oom_backoff": st.floats(0.05, 0.95),
        "clean_batches_to_raise": st.integers(1, 30),
        "budget_step": st.floats(0.01, 1.0),
    }
)


def apply(gov: BudgetGovernor, event: tuple[str, int]) -> BudgetGovernor:
    kind, value = event
    return gov.after_oom(value) if kind == "oom" else gov.after_batch(value)


@given(st.integers(1, 1 << 40), policies, events)
@settings(max_examples=300, deadline=None)
def test_budget_stays_between_floor_and_configured(
    configured: int, policy: dict, history: list[tuple[str, int]]
) -> None:
    gov = BudgetGovernor.start(configured, **policy)
    ooms = 0
    for event in history:
        before = gov
        gov = apply(gov, event)
        assert gov.floor_bytes <= gov.budget_bytes <= configured
        if event[0] == "oom":
            ooms += 1
            # Lowered to the backed-off prediction, never raised, never below the floor.
            expected = max(
                gov.floor_bytes, min(before.budget_bytes, int(event[1] * gov.oom_backoff))
            )
            assert gov.budget_bytes == expected <= before.budget_bytes
            assert gov.clean_batches == 0
        else:
            assert gov.budget_bytes >= before.budget_bytes  # a batch never lowers it
            if event[1]:
                assert gov.budget_bytes == before.budget_bytes and gov.clean_batches == 0
        assert gov.oom_events == ooms


@given(
    st.integers(16, 1 << 40), policies, st.lists(st.integers(0, 1 << 40), min_size=1, max_size=5)
)
@settings(max_examples=200, deadline=None)
def test_clean_batches_bring_the_configured_budget_back(
    configured: int, policy: dict, predictions: list[int]
) -> None:
    gov = BudgetGovernor.start(configured, **policy)
    for p in predictions:
        gov = gov.after_oom(p)
    lowered = gov.budget_bytes
    n = gov.clean_batches_to_raise
    # One OOM-free batch short of the period: nothing moves yet.
    for _ in range(n - 1):
        gov = gov.after_batch(0)
    assert gov.budget_bytes == lowered
    step = max(1, int(configured * gov.budget_step))
    raises = math.ceil((configured - lowered) / step)
    for _ in range(1 + n * (raises - 1) if raises else 0):
        gov = gov.after_batch(0)
    assert gov.budget_bytes == configured
    assert gov.after_batch(0).budget_bytes == configured  # and never beyond


def test_an_oom_restarts_the_clean_count() -> None:
    gov = BudgetGovernor.start(1000, clean_batches_to_raise=3, budget_step=0.1)
    gov = gov.after_oom(1000)  # 800
    gov = gov.after_batch(0).after_batch(0)
    gov = gov.after_batch(1)  # a batch that recovered from an OOM is not clean
    gov = gov.after_batch(0).after_batch(0)
    assert gov.budget_bytes == 800
    assert gov.after_batch(0).budget_bytes == 900


def test_backoff_figures_and_floor() -> None:
    gov = BudgetGovernor.start(160_000)  # 0.8 backoff, floor 1/16
    assert gov.after_oom(160_000).budget_bytes == 128_000
    assert gov.after_oom(160_000).after_oom(80_000).budget_bytes == 64_000
    assert gov.after_oom(1).budget_bytes == gov.floor_bytes == 10_000
    assert gov.after_oom(10**12).budget_bytes == 160_000  # a huge prediction never raises it
    # A single image is retried below what failed, whatever the floor.
    assert gov.retry_bytes(5_000) == 4_000 < gov.floor_bytes


@pytest.mark.parametrize(
    "kwargs",
    [
        {"configured_bytes": 0},
        {"oom_backoff": 1.0},
        {"oom_backoff": 0.0},
        {"budget_step": 0.0},
        {"clean_batches_to_raise": 0},
    ],
)
def test_invalid_policy_refused(kwargs: dict) -> None:
    args = {"configured_bytes": 100, "budget_bytes": 100, **kwargs}
    with pytest.raises(ValueError):
        BudgetGovernor(**args)
