"""The running loop's memory, as arithmetic: a KV pool of token ranges, slots, and who goes next.

Pure (no torch, no device): the loop's scheduler (ocrq/models/loop/scheduler.py) keeps its KV
book with it, the batcher asks it whether the loop can ever hold a row (`RunningBudget.fits_alone`,
ocrq/scheduling/streaming.py), and the property tests drive it alone.

Why one pool of contiguous token ranges and not a static cache per slot or paged blocks:

* a static cache per slot must size every slot for the longest row (an A4 page: ~2,300 prompt +
  1,024 new tokens), so a word crop (~100 tokens) would hold 30x the memory it uses and far
  fewer rows would run at once within one budget;
* paged blocks fit rows tightly but put a block table between the decode kernel and every key
  block; a contiguous range per row keeps the Triton decode kernel as it is (each row reads
  [start, end) of one tensor, ocrq/models/hunyuan/attention.py) and the CUDA graph unchanged;
* the price of ranges is external fragmentation: a row may wait although the free tokens add up.
  It cannot starve: admission is first-in-first-out, so while the oldest row waits nothing
  younger is placed, rows in flight finish, and their ranges merge with their free neighbours
  (an empty pool is one range, which every row the planner lets in fits).

A row's range holds its prompt and its new tokens but the last (never fed back), so the budget
of the running set is exactly: weights + the pool + one prefill pass's activations + per-slot
state, all sized once when the loop starts (`RunningBudget`), and the loop's scheduler keeps the
rows in flight within the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ocrq.models.costs import CostModel, ItemCost

GRANULE = 16  # ranges are multiples of this many tokens, so freed ones merge into usable holes
FULL_PASS = "prefill pass full"  # `Admission.blocked` when the pass, not the pool, stopped it


def round_up(tokens: int) -> int:
    return -(-max(tokens, 1) // GRANULE) * GRANULE


def capacity_of(prompt_tokens: int, max_new_tokens: int) -> int:
    """Pool tokens a row holds: its prompt and every new token but the last, rounded up."""
    return round_up(prompt_tokens + max(max_new_tokens - 1, 0))


@dataclass(frozen=True)
class KvPool:
    """Free token ranges of a pool of `size` tokens, as sorted (start, length) pairs.

    Immutable: `take` and `give` return a new pool, so the planner can try placements without
    side effects and the property tests can compare states."""

    size: int
    free: tuple[tuple[int, int], ...]

    @classmethod
    def empty(cls, size: int) -> KvPool:
        return cls(size, ((0, size),) if size > 0 else ())

    @property
    def free_tokens(self) -> int:
        return sum(n for _, n in self.free)

    def take(self, tokens: int) -> tuple[int, KvPool] | None:
        """First fit: (start, pool after) for a range of `tokens`, or None when no hole is large
        enough."""
        for i, (start, n) in enumerate(self.free):
            if n >= tokens:
                rest = ((start + tokens, n - tokens),) if n > tokens else ()
                return start, KvPool(self.size, self.free[:i] + rest + self.free[i + 1 :])
        return None

    def give(self, start: int, tokens: int) -> KvPool:
        """The pool with [start, start + tokens) free again, merged with free neighbours."""
        ranges = sorted([*self.free, (start, tokens)])
        merged: list[tuple[int, int]] = []
        for s, n in ranges:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                if merged and merged[-1][0] + merged[-1][1] > s:
                    raise ValueError(f"range {s}+{n} overlaps a free range: freed twice?")
                merged.append((s, n))
        return KvPool(self.size, tuple(merged))


@dataclass(frozen=True)
class Candidate:
    """A row waiting for a slot: its key, prompt tokens and the pool tokens it will hold."""

    key: str
    prompt_tokens: int
    capacity: int


@dataclass(frozen=True)
class Placement:
    key: str
    slot: int
    start: int  # first pool token of its range
    capacity: int


@dataclass(frozen=True)
class Admission:
    """Rows to prefill now, oldest first, and the pool once they hold their ranges."""

    placements: tuple[Placement, ...]
    pool: KvPool
    blocked: str | None = None  # why the oldest row left waiting was not admitted


def admit(
    waiting: Sequence[Candidate],
    pool: KvPool,
    free_slots: Sequence[int],
    prefill_tokens: int,
    *,
    packed: bool = False,
) -> Admission:
    """The oldest waiting rows that fit, in order, stopping at the first that does not.

    A row fits when a slot is free, its range finds a hole in the pool, and the pass's prompt
    tokens stay within `prefill_tokens`: padded, rows x the longest prompt; `packed` (rows end
    to end, ocrq/models/hunyuan/packed.py), the sum of the prompts. One row alone always passes
    that last test (the planner never hands over a row whose prompt alone is over it). Stopping
    at the first misfit, instead of letting younger rows pass it, is what keeps a long row from
    waiting for ever behind a stream of short ones.
    """
    slots = sorted(free_slots)
    placed: list[Placement] = []
    longest = total = 0
    for row in waiting:
        if len(placed) >= len(slots):
            return Admission(tuple(placed), pool, "no free slot")
        longest_then = max(longest, row.prompt_tokens)
        cost = total + row.prompt_tokens if packed else (len(placed) + 1) * longest_then
        if placed and cost > prefill_tokens:
            return Admission(tuple(placed), pool, FULL_PASS)
        taken = pool.take(row.capacity)
        if taken is None:
            return Admission(tuple(placed), pool, "no pool range")
        start, pool = taken
        placed.append(Placement(row.key, slots[len(placed)], start, row.capacity))
        longest = longest_then
        total += row.prompt_tokens
    return Admission(tuple(placed), pool)


@dataclass(frozen=True)
class RunningBudget:
    """What the running loop allocates once, from the memory budget and the cost model.

    predicted peak = fixed (weights) + pool + one prefill pass + per-slot state + the decode
    step's workspaces (`decode_fixed_bytes`), whatever rows run: every term is allocated at the
    start or bounded by `admit`.
    """

    slots: int
    pool_tokens: int
    prefill_tokens: int
    pool_bytes: int
    prefill_bytes: int
    state_bytes: int
    decode_fixed_bytes: int
    # Of `slots`, those only interactive rows take (OCRQ_INTERACTIVE_SLOTS): bulk rows hold at
    # most `slots - reserved_slots` (the loop's `lane_pass`).
    reserved_slots: int = 0

    @classmethod
    def plan(
        cls,
        model: CostModel,
        budget_bytes: int,
        *,
        slots: int,
        prefill_tokens: int,
        state_bytes_per_slot: int = 0,
    ) -> RunningBudget:
        """Size the pool from `budget_bytes` (above the model's fixed part): what remains after
        a prefill pass of `prefill_tokens` padded tokens, the slots' state and the decode
        workspaces. Raises ValueError when nothing remains."""
        token_bytes = model.per_cache_token_bytes
        if token_bytes <= 0:
            raise ValueError("the cost model has no per-cached-token bytes: no KV pool to size")
        # Up to `slots` rows of at most `prefill_tokens` padded tokens in all.
        prefill = int(
            model.prefill_bytes([prefill_probe(prefill_tokens)])
            + model.per_item_bytes * (slots - 1)
        )
        state = slots * state_bytes_per_slot
        decode_fixed = int(model.decode_fixed_bytes)
        room = budget_bytes - prefill - state - decode_fixed
        tokens = int(room // token_bytes) // GRANULE * GRANULE
        if tokens < GRANULE:
            raise ValueError(
                f"a budget of {budget_bytes / 2**30:.2f} GiB leaves no KV pool after a prefill "
                f"pass of {prefill_tokens} tokens ({prefill / 2**30:.2f} GiB) and {slots} slots"
            )
        return cls(
            slots, tokens, prefill_tokens, int(tokens * token_bytes), prefill, state, decode_fixed
        )

    @property
    def bytes(self) -> int:
        """Above the fixed part: what the loop may hold at its peak."""
        return self.pool_bytes + self.prefill_bytes + self.state_bytes + self.decode_fixed_bytes

    def fits_alone(self, cost: ItemCost, max_new_tokens: int) -> bool:
        """Whether one row can ever run: its range within the pool, its prompt within a pass."""
        return (
            capacity_of(cost.prompt_tokens, max_new_tokens) <= self.pool_tokens
            and cost.prompt_tokens <= self.prefill_tokens
        )

    def need(self, cost: ItemCost, max_new_tokens: int) -> float:
        """How much of the loop one row needs alone, as a share (<= 1: it fits): the planner's
        measure when it downscales a row too big for the loop."""
        return max(
            capacity_of(cost.prompt_tokens, max_new_tokens) / self.pool_tokens,
            cost.prompt_tokens / self.prefill_tokens,
        )


def prefill_probe(prefill_tokens: int) -> ItemCost:
    """One row of `prefill_tokens` prompt tokens, all image tokens (the vision tower's patches
    are 4 per image token): the most a prefill pass of that many tokens holds by the model."""
    return ItemCost(tokens=prefill_tokens, patches=4 * prefill_tokens, pixels=0)
