"""Choose the next batch from the waiting images: a pure function of items, budget and model.

The planner decides and returns a frozen Plan; the batcher executes it and never re-decides.
Rules, in order:
1. The oldest waiting item always leads the batch, so nothing starves.
2. The rest are taken by similarity of sequence length to the leader (padding to the longest
   sequence is paid by every member), ties broken by age.
3. An item joins only if the model's predicted bytes for the batch stay within the budget and the
   batch stays within max_items.
4. If the leader alone is over the budget it is reported as oversize, alone, and the batch is
   empty: the caller shrinks that image and plans again. It is never sent into an OOM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from models.costs import CostModel, ItemCost


@dataclass(frozen=True)
class Waiting:
    key: str
    cost: ItemCost
    seq: int  # arrival order; lower is older


@dataclass(frozen=True)
class Plan:
    keys: tuple[str, ...]  # the batch, leader first
    predicted_bytes: int  # model's batch bytes above the fixed part
    budget_bytes: int  # the budget this plan was made under (above the fixed part)
    deferred: tuple[str, ...]  # waiting items left for a later batch, oldest first
    oversize: tuple[str, ...] = ()  # leader over budget alone: shrink, then plan again


def plan(waiting: Sequence[Waiting], budget_bytes: int, model: CostModel, max_items: int) -> Plan:
    if max_items < 1:
        raise ValueError("max_items must be >= 1")
    if not waiting:
        return Plan((), 0, budget_bytes, ())
    by_age = sorted(waiting, key=lambda w: w.seq)
    leader = by_age[0]
    if model.batch_bytes([leader.cost]) > budget_bytes:
        rest = tuple(w.key for w in by_age[1:])
        return Plan((), 0, budget_bytes, rest, oversize=(leader.key,))

    chosen = [leader]
    costs = [leader.cost]
    candidates = sorted(by_age[1:], key=lambda w: (abs(w.cost.tokens - leader.cost.tokens), w.seq))
    for cand in candidates:
        if len(chosen) >= max_items:
            break
        if model.batch_bytes([*costs, cand.cost]) <= budget_bytes:
            chosen.append(cand)
            costs.append(cand.cost)
    taken = {w.key for w in chosen}
    predicted = model.batch_bytes(costs)
    assert predicted <= budget_bytes and len(chosen) <= max_items
    return Plan(
        keys=tuple(w.key for w in chosen),
        predicted_bytes=predicted,
        budget_bytes=budget_bytes,
        deferred=tuple(w.key for w in by_age if w.key not in taken),
    )
