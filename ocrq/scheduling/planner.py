"""Choose the next batch from the waiting images: a pure function of items, budget and model.

The planner decides and returns a frozen Plan; the batcher executes it and never re-decides.
Rules, in order:
0. Items are admitted in lane order (`LaneRule`, ocrq/core/lanes.py, the running loop's too;
   `admission_order`): interactive items first, then bulk ones, first in first out within a
   lane; a bulk item that has waited `bulk_max_wait_s` joins the interactive lane in its arrival
   order, so bulk never starves.
1. The first item in that order always leads the batch, so nothing starves.
2. The rest are taken interactive lane first, then by similarity of sequence length to the
   leader (padding to the longest sequence is paid by every member), ties broken by age.
3. An item joins only if the model's predicted bytes for the batch stay within the budget and the
   batch stays within max_items.
4. If the leader alone is over the budget, the batch is empty and the plan says what becomes of
   the leader: downscaled to the pixel count found by halving until the model says it fits
   (`shrink_to_fit`), or refused with the reason when no size does. The batcher applies that and
   plans again. An image is never sent into an OOM by the planner.

After an out-of-memory error the planner decides too (`after_oom`): a batch is split in halves,
a single image is retried at a size predicted below what failed, or refused.

Sizes are searched through `estimate_at(key, pixels)`, the engine's estimate of that item
downscaled to at most `pixels`: the planner never touches images, only costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ocrq.core.contract import BULK, INTERACTIVE, Priority
from ocrq.core.lanes import DEFAULT_LANES, LaneRule
from ocrq.models.costs import CostModel, GiB, ItemCost
from ocrq.models.slots import RunningBudget

# The cost of item `key` downscaled to at most `pixels` pixels (aspect ratio kept).
EstimateAt = Callable[[str, int], ItemCost]


@dataclass(frozen=True)
class ShrinkRule:
    min_pixels: int = 64 * 64  # an image this small is not shrunk further
    max_steps: int = 12  # halvings tried at most


@dataclass(frozen=True)
class Waiting:
    key: str
    cost: ItemCost
    seq: int  # arrival order; lower is older
    pixels: int = 0  # the image's pixels now (w*h); 0: it cannot be downscaled
    lane: Priority = BULK  # the job's priority (ocrq.core.contract.PRIORITIES)
    waited_s: float = 0.0  # since it was handed to the batcher, at planning time


def rank(w: Waiting, lanes: LaneRule) -> int:
    """The item's lane rank (`LaneRule.rank`): 0 interactive or promoted, 1 other bulk."""
    return lanes.rank(w.lane == INTERACTIVE, w.waited_s)


def admission_order(waiting: Sequence[Waiting], lanes: LaneRule) -> list[Waiting]:
    """The order in which waiting items may be admitted: (rank, arrival), `LaneRule`'s."""
    return sorted(waiting, key=lambda w: (rank(w, lanes), w.seq))


@dataclass(frozen=True)
class Downscale:
    """Shrink item `key` to at most `pixels` pixels; it then costs `cost`."""

    key: str
    pixels: int
    cost: ItemCost


@dataclass(frozen=True)
class Refusal:
    """Item `key` fits at no size: fail its job with `reason`."""

    key: str
    reason: str


@dataclass(frozen=True)
class Plan:
    keys: tuple[str, ...]  # the batch, leader first
    predicted_bytes: int  # model's batch bytes above the fixed part
    budget_bytes: int  # the budget this plan was made under (above the fixed part)
    # Waiting items left for a later batch, in admission order. With fewer keys than max_items, a
    # non-empty `deferred` means the budget, not the count, closed the batch (logs, metrics).
    deferred: tuple[str, ...]
    downscale: tuple[Downscale, ...] = ()  # the leader, over budget alone, made smaller
    refused: tuple[Refusal, ...] = ()  # the leader, over budget alone at any size

    @property
    def oversize(self) -> tuple[str, ...]:
        """Items over the budget alone (downscaled or refused); the batch is then empty."""
        return tuple(d.key for d in self.downscale) + tuple(r.key for r in self.refused)


@dataclass(frozen=True)
class Recovery:
    """What to do after a batch ran out of memory: run its halves, or retry/refuse its one item."""

    halves: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    retry: Downscale | Refusal | None = None


def plan(
    waiting: Sequence[Waiting],
    budget_bytes: int,
    model: CostModel,
    max_items: int,
    estimate_at: EstimateAt | None = None,
    rule: ShrinkRule = ShrinkRule(),
    lanes: LaneRule = DEFAULT_LANES,
) -> Plan:
    if max_items < 1:
        raise ValueError("max_items must be >= 1")
    if not waiting:
        return Plan((), 0, budget_bytes, ())
    by_age = admission_order(waiting, lanes)
    leader = by_age[0]
    if model.batch_bytes([leader.cost]) > budget_bytes:
        rest = tuple(w.key for w in by_age[1:])
        fate = shrink_to_fit(leader, budget_bytes, model, estimate_at, rule)
        if isinstance(fate, Downscale):
            return Plan((), 0, budget_bytes, rest, downscale=(fate,))
        return Plan((), 0, budget_bytes, rest, refused=(fate,))

    chosen = [leader]
    costs = [leader.cost]
    # With no interactive item waiting, lanes do not change who joins (the length rule does).
    mixed = any(w.lane == INTERACTIVE for w in by_age)
    candidates = sorted(
        by_age[1:],
        key=lambda w: (
            rank(w, lanes) if mixed else 0,
            abs(w.cost.tokens - leader.cost.tokens),
            w.seq,
        ),
    )
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


def shrink_to_fit(
    item: Waiting,
    limit_bytes: int,
    model: CostModel,
    estimate_at: EstimateAt | None,
    rule: ShrinkRule = ShrinkRule(),
    alone: Callable[[ItemCost], int] | None = None,
) -> Downscale | Refusal:
    """Halve the item's pixels until the model says it fits `limit_bytes` alone.

    Always shrinks at least once (callers ask only when the present size does not fit). Stops
    with a refusal at `rule.min_pixels`, after `rule.max_steps` halvings, or as soon as a
    smaller size costs no less (an engine that upscales small images: shrinking cannot help).
    `alone` is what one item needs (default: the model's bytes of a batch of it alone).
    """
    need_of = alone or (lambda c: model.batch_bytes([c]))
    before = need_of(item.cost)
    limit = f"the budget {limit_bytes / GiB:.2f} GiB"
    if estimate_at is None or item.pixels <= 0:
        return Refusal(item.key, f"image needs {before / GiB:.2f} GiB alone, over {limit}")
    pixels = item.pixels
    for _ in range(rule.max_steps):
        if pixels <= rule.min_pixels:
            break
        pixels //= 2
        try:
            cost = estimate_at(item.key, pixels)
        except Exception as exc:  # the engine refuses the smaller image (too thin, say)
            return Refusal(item.key, f"image cannot be downscaled to fit {limit}: {exc}")
        need = need_of(cost)
        if need <= limit_bytes:
            return Downscale(item.key, pixels, cost)
        if need >= before:
            return Refusal(
                item.key,
                f"image needs {need / GiB:.2f} GiB alone, over {limit}, and a smaller image "
                "costs no less",
            )
        before = need
    return Refusal(
        item.key, f"image needs {before / GiB:.2f} GiB alone even at {pixels} pixels, over {limit}"
    )


def after_oom(
    failed: Sequence[Waiting],
    retry_bytes: int,
    model: CostModel,
    estimate_at: EstimateAt | None,
    rule: ShrinkRule = ShrinkRule(),
) -> Recovery:
    """How to go on after the batch `failed` (in batch order) ran out of memory.

    Several items: run each half on its own (recursively, by the same rule). One item: retry it
    downscaled until it is predicted at most `retry_bytes` (the governor's backoff of what
    failed), or refuse it.
    """
    if not failed:
        raise ValueError("an empty batch cannot run out of memory")
    if len(failed) > 1:
        keys = tuple(w.key for w in failed)
        mid = len(keys) // 2
        return Recovery(halves=(keys[:mid], keys[mid:]))
    return Recovery(retry=shrink_to_fit(failed[0], retry_bytes, model, estimate_at, rule))


def fit_running(
    item: Waiting,
    loop: RunningBudget,
    estimate_at: EstimateAt | None = None,
    rule: ShrinkRule = ShrinkRule(),
) -> Downscale | Refusal | None:
    """Whether a row may go to a running loop (continuous batching) as it is: None when the
    loop can hold it alone (its KV range within the pool, its prompt within a pass); else
    downscaled until it can, or refused, as `plan` does with a leader over the budget.

    A check of one row, not a plan: which rows run when, against the rows already in the loop,
    is the loop's own scheduler's (ocrq/models/loop/scheduler.py), which holds the only waiting
    queue, lane rule and KV book; the batcher hands it every row that passes this."""
    if loop.fits_alone(item.cost, item.cost.new_tokens):
        return None
    share = loop.bytes

    def alone(cost: ItemCost) -> int:
        return int(loop.need(cost, cost.new_tokens) * share)

    return shrink_to_fit(item, share, CostModel(0), estimate_at, rule, alone=alone)
