"""The running loop (continuous batching): its scheduler plans, its runner executes, tick by tick.

Why two parts, as vLLM v1 splits its scheduler from its model runner: which rows run when (the
only waiting queue, the lanes' rule, the KV book: `LoopScheduler`, ocrq/models/loop/, pure and
tested without torch) and what the device does (slots, pool tensors, graphs, decode steps, the
repetition guard, the harvest: `LoopRunner`, ocrq/models/hunyuan/runner.py) change for
different reasons and are checked in different ways. `RunningLoop` only joins them; each tick:

    ready = runner.land()                       # a pending prefill pass committed if done
    plan = scheduler.schedule(now, ready)       # drops, admissions, decode steps
    output, ended = runner.execute(plan, rows)  # carried out; the rows that ended
    finished = scheduler.update(output)         # their slots and ranges free, each row once

Why the loop policy sits in ocrq/models/loop/ and not in ocrq/scheduling/: this loop is an
engine (ocrq/models/hunyuan/loop_engine.py), and an engine may not import the batcher's layer
above it (pyproject.toml's import-linter layers); the policy is still pure, a contract of its
own keeps torch and the engines out of it.

The time the scheduler plans with (a row's wait, for the lanes' promotion after
OCRQ_BULK_MAX_WAIT_S) is read here, `time.monotonic()`, and handed to `add` and `schedule`: the
scheduler reads no clock.

What it holds beside the two: the `LoopRow`s handed in and not admitted yet, by key (their
encoded prompts, which the scheduler's plain requests do not carry), so that an admission can
hand the runner its rows. That map decides nothing: the order is the scheduler's queue.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from ocrq.models.hunyuan.loop_types import Done, LoopConfig, LoopRow, LoopStats
from ocrq.models.hunyuan.runner import LoopRunner
from ocrq.models.loop import LoopScheduler, Request, SchedulerConfig, StepOutput, StepPlan
from ocrq.models.slots import KvPool

if TYPE_CHECKING:
    from ocrq.models.hunyuan.decode import HunyuanDecoder
    from ocrq.models.hunyuan.hooks import DecodeHooks
    from ocrq.models.hunyuan.tokens import SpecialTokens


def scheduler_config(config: LoopConfig) -> SchedulerConfig:
    """The scheduler's half of the loop's config: its shape, prefill schedule and lanes."""
    return SchedulerConfig(
        slots=config.slots,
        pool_tokens=config.pool_tokens,
        max_new_tokens=config.max_new_tokens,
        schedule=config.schedule,
        pass_tokens=config.pass_tokens,
        prefill_gap=config.prefill_gap,
        packed=config.packed,
        check_every=config.check_every,
        lanes=config.lanes,
    )


class RunningLoop:
    """One running loop: a `LoopScheduler` and the `LoopRunner` that carries out its plans."""

    def __init__(
        self,
        decoder: HunyuanDecoder,
        tokens: SpecialTokens,
        config: LoopConfig,
        hooks: DecodeHooks | None = None,
        runner: type[LoopRunner] = LoopRunner,
    ) -> None:
        """`hooks`: a bench's (ocrq/models/hunyuan/hooks.py); `runner`: a test's subclass."""
        self.config = config
        self.scheduler = LoopScheduler(scheduler_config(config))
        self.runner = runner(decoder, tokens, config, hooks)
        self._queued: dict[str, LoopRow] = {}  # rows handed in, not admitted yet, by key

    # -- rows in and out -----------------------------------------------------------------------

    def add(self, rows: Sequence[LoopRow]) -> None:
        """Queue rows, oldest first; each must fit the pool alone (ValueError: none is queued)."""
        self.scheduler.add(
            [Request(r.key, r.prompt_tokens, r.max_new_tokens, r.interactive) for r in rows],
            time.monotonic(),
        )
        hooks = self.runner.hooks
        for row in rows:
            row.eos_at = hooks.eos_at(row.key) if hooks is not None else None
            self._queued[row.key] = row

    def idle(self) -> bool:
        return self.scheduler.idle() and self.runner.idle()

    def run(self, timeout_s: float | None = None) -> list[Done]:
        """Tick until at least one row finishes (returning those finished since the last call),
        nothing is left, or `timeout_s` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        done: list[Done] = []
        runner = self.runner
        with runner.session():
            while not done and not self.idle():
                ready = runner.land()
                plan = self.scheduler.schedule(time.monotonic(), prefill=ready)
                done = self._update(*runner.execute(plan, self._admitted(plan), deadline))
                if deadline is not None and time.monotonic() >= deadline:
                    break
            if not done and runner.rows:
                done = self._update(*runner.harvest_now())
        return done

    def drain(self) -> list[Done]:
        """Every row queued, run to its end (tests and the bench)."""
        done: list[Done] = []
        while not self.idle():
            done += self.run()
        self.collect_stats(wait=True)
        return done

    def drop(self, keys: Collection[str]) -> list[LoopRow]:
        """Forget these rows (their jobs were cancelled), waiting or running; the rows dropped.
        A running row leaves the device at the next tick (the plan's `drop`), before anything
        else runs; its slot and range are the scheduler's again now, and it never comes back as
        done."""
        if not keys:
            return []
        gone = self.scheduler.drop(keys)
        running = {r.key: r for r in self.runner.rows.values()}
        pending = self.runner.passes.pending
        if pending is not None:
            running.update((r.key, r) for r in pending.rows)
        return [self._queued.pop(k, None) or running[k] for k in gone]

    def clear(self) -> list[LoopRow]:
        """Forget every row (after an error); the rows that were on the device, in a pending
        prefill pass or waiting."""
        self.scheduler.clear()
        rows = self.runner.clear() + list(self._queued.values())
        self._queued.clear()
        return rows

    def _admitted(self, plan: StepPlan) -> list[LoopRow]:
        """The rows the plan admits, in pass order, with the slots and ranges it gave them."""
        rows = []
        for a in plan.admit:
            row = self._queued.pop(a.key)
            row.slot, row.start, row.capacity = a.slot, a.start, a.capacity
            rows.append(row)
        return rows

    def _update(self, output: StepOutput, ended: list[Done]) -> list[Done]:
        finished = set(self.scheduler.update(output))
        return [d for d in ended if d.row.key in finished]

    # -- what the engine, the warm-up, the tests and the bench read ---------------------------

    def warm_up(self, row: LoopRow | None, deadline: float) -> list[int]:
        """Before the first job: `row` run through, or (None) every bucket's step captured by
        `deadline` (ocrq/models/hunyuan/warm_up.py); the buckets graphed."""
        from ocrq.models.hunyuan.warm_up import warm_up

        return warm_up(self, row, deadline)

    def collect_stats(self, wait: bool = False) -> LoopStats:
        return self.runner.collect_stats(wait)

    @property
    def waiting(self) -> list[LoopRow]:
        """The rows waiting, in the scheduler's queue order."""
        return [self._queued[k] for k in self.scheduler.waiting_keys()]

    @property
    def pool(self) -> KvPool:
        """The KV pool's free ranges: the scheduler's book."""
        return self.scheduler.pool

    @property
    def rows(self) -> dict[int, LoopRow]:
        """Slot -> live row (the runner's)."""
        return self.runner.rows

    @property
    def live(self) -> int:
        return self.runner.live

    @property
    def stats(self) -> LoopStats:
        return self.runner.stats
