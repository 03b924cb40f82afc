"""The running loop's runner: a fixed set of slots on the device, rows leaving and joining between
steps as the loop's scheduler plans.

Why: the static loop (ocrq/models/hunyuan/decode.py) runs a batch until its longest row ends, so a
word crop waits for an A4 page of its batch, freed rows leave their slots idle, and the next
batch's prefill waits for the whole decode. Here a row that ends (an eos, its own
`max_new_tokens`, the repetition guard) is handed back from the next copy of the slots' state
that reaches the host (ocrq/models/hunyuan/readback.py: the host never waits for the GPU in
steady state) and its slot and KV range are given to the oldest waiting row, prefilled between
decode steps (or beside them, on a side stream: `LoopConfig.prefill_stream`,
ocrq/models/hunyuan/passes.py).

Layout (ocrq/models/slots.py says why a pool of ranges):

* one KV pool per layer, (1, KV heads, pool tokens + 1 + PAD_KEYS, head dim) rounded up to
  128 columns, allocated once, zeroed; row r holds [start_r, start_r + capacity_r); column
  `pool tokens` is scratch, where slots without a live row write and read, so a step needs no
  branch on which slots are live; the columns past it are never written. An fp8 pool stores
  its values transposed (head dim, then tokens; the tensors seen are views with the usual
  shape) and is read padded, unmasked past the scratch column: on an H200 its decode attention
  10% faster than token-major (ocrq/models/hunyuan/attention.py, `TritonDecodeAttention`);
  a bf16 pool is faster token-major and keeps that layout;
* every per-slot tensor (token fed, RoPE positions, the column written, visible range, token
  count, own cap, finished, output tokens, repetition-penalty mask) has a fixed address, so a
  step over the first `k` slots can be captured in a CUDA graph once per bucket `k` and replayed
  whatever rows come and go; rows take the lowest free slot, so the bucket shrinks as the queue
  drains (with interactive-only steps, below, interactive rows the lowest of all, bulk rows the
  lowest above the lane's reserve: ocrq/models/loop/lane_pass.py);
* the Triton decode kernel reads row r's keys [start_r, end_r) of the pool expanded over the
  rows (batch stride 0); the torch reference reads the pool under a per-slot mask, which admission
  clears (`SlotTensors.forget_keys`) before a new row's prompt is marked: the tests show that
  skipping that clear lets an old row's keys leak into the new one.

Split as vLLM splits its scheduler from its runner: this runner holds the device state (the pool
and every per-slot tensor, ocrq/models/hunyuan/slot_tensors.py; the graphs; the books of the rows
on the device, `LoopBooks`, ocrq/models/hunyuan/loop_state.py) and carries out the plans of the
loop's scheduler (ocrq/models/loop/scheduler.py: the waiting queue, the lanes, the KV book), one
`StepPlan` at a time (`execute`): drop the rows it names, prefill the rows it admits into the
slots and ranges it gave them (ocrq/models/hunyuan/passes.py), run the decode steps, read back
the rows that ended (ocrq/models/hunyuan/harvest.py), and say so in a `StepOutput`. It decides
nothing about which rows run when; ocrq/models/hunyuan/running.py drives the two. The words they
share (rows, config, stats) are ocrq/models/hunyuan/loop_types.py.

The greedy arithmetic (scores, repetition penalty, eos ban, the guard's rule) is the static
loop's, per row; a row's tokens do not depend on the rows beside it (tests).

A step's logits come from today's step (`TextModel.step`), or, for buckets of few slots where the
lab lever OCRQ_LOOP_FUSED_STEP_ROWS asks, from the fused few-row step (step_choice.py).

Interactive-only steps (`LanePolicy.extra_steps`, OCRQ_INTERACTIVE_EXTRA_STEPS): with a bulk
backlog an interactive row's token waits for a step over every live row plus the bulk passes
run between steps (~20-30 ms on an H200 against 2.6 ms alone). After each full step, while an
interactive row is live, the loop runs that many more steps over only the smallest bucket of
slots holding every live interactive row of the lane's reserve (its lowest slots), ~2 ms each
on an H200, so such a row makes up to 1 + extra_steps tokens per full step. An interactive row
that found the reserve full sits among the bulk rows and gets no extra steps: covering it would
make each one a full step (8-13 ms on the H200 when the reserve overflowed). A step is valid for
every row it covers, whichever: a bulk row below that bucket simply gets a token more. What
changes is the host's arithmetic of a row's token count, no longer the steps since its prefill:
each row counts the tokens it made in such steps (`LoopRow.extra`), and the repetition guard,
the harvest's cap prediction and the KV figures add them (`_made`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.greedy import greedy_next
from ocrq.models.hunyuan.harvest import Harvest
from ocrq.models.hunyuan.hooks import DecodeHooks
from ocrq.models.hunyuan.kv_cache import is_fp8
from ocrq.models.hunyuan.loop_state import LoopBooks, LoopParts
from ocrq.models.hunyuan.loop_types import Done, LoopConfig, LoopRow, LoopStats
from ocrq.models.hunyuan.passes import PrefillPasses
from ocrq.models.hunyuan.readback import GpuClock, Readback, Snapshot, to_device
from ocrq.models.hunyuan.repetition import LoopFinder, guard_due
from ocrq.models.hunyuan.slot_tensors import SlotTensors
from ocrq.models.hunyuan.step_choice import fused_steps
from ocrq.models.hunyuan.tokens import SpecialTokens
from ocrq.models.loop import StepOutput, StepPlan

if TYPE_CHECKING:
    from ocrq.models.hunyuan.decode import HunyuanDecoder

log = logging.getLogger(__name__)

# Interactive-only steps queued at once in a side-stream pass's shadow (`LanePolicy.pass_steps`),
# and how long the loop thread sleeps when that many are: two keep the loop's stream busy
# while the host launches the next; each ~1.5-2 ms on a Hopper GPU.
SHADOW_IN_FLIGHT = 2
SHADOW_POLL_S = 0.0002


# The decode step's greedy choice by Triton kernels where the loop's attention is Triton's
# (ocrq/models/hunyuan/greedy.py; the same tokens as `SlotTensors.scores` + argmax). A
# constant, not a setting: bench/loop_profile.py flips it (--greedy torch) to time both.
FUSED_GREEDY = True


class LoopRunner:
    """Slots, a KV pool and the rows in them, for one loaded model on one device: no queue, no
    policy (the module's docstring)."""

    def __init__(
        self,
        decoder: HunyuanDecoder,
        tokens: SpecialTokens,
        config: LoopConfig,
        hooks: DecodeHooks | None = None,
    ) -> None:
        """`hooks`: a bench's (ocrq/models/hunyuan/hooks.py); None, the service's, leaves the
        step as the model makes it."""
        import torch

        self.decoder = decoder
        self.hooks = hooks
        self.text = decoder.text
        self.tokens = tokens
        self.config = config
        self.device = decoder.device
        self.graphs: dict[int, Any] = {}
        self._graph_pool: Any = None
        self._kernels: dict[int, Any] = {}
        self._finder = (
            LoopFinder(config.guard, self.device) if config.guard is not None else None
        )
        self.use_triton = decoder.attention == "triton"
        self.fused_greedy = self.use_triton and FUSED_GREEDY
        self.tensors = SlotTensors(
            self.text, tokens, config, self.device,
            track_valid=not self.use_triton, forced=hooks is not None,
        )
        # What its collaborators share: the books, the device tensors, the account, the clocks.
        self.state = LoopParts(
            decoder, tokens, config, LoopBooks.empty(config), self.tensors, LoopStats(),
            GpuClock(bool(decoder.is_cuda)), Readback(config.slots, config.max_new_tokens,
                                                      self.device),
        )
        # The fused few-row step for the smallest buckets, where the lab lever asks and it fits
        # (ocrq/models/hunyuan/step_choice.py); None: today's step for every bucket.
        self.fused_steps = fused_steps(
            self.text, config, self.device, use_triton=self.use_triton,
            kv_dtype=self.tensors.kv_dtype, padded=self.tensors.values_transposed,
        )
        self.books = self.state.books
        self._pass_launched_at = -1  # `step_no` when the last prefill pass was launched
        self._shadow_events: deque[Any] = deque()  # steps queued in a pass's shadow, unfinished
        self._tick = (0.0, 0.0)  # perf_counter and thread_time when this tick began (`land`)
        # Its collaborators: when to read the slots' state back for the rows that ended, and
        # the passes that prefill rows.
        self.harvest = Harvest(self.state, self._ended)
        self.passes = PrefillPasses(self.state, self.harvest)
        # With `prefill_stream` on a GPU: the loop's own stream (steps, graph replays, copies
        # to the host, commits), high priority, and the passes' side stream, low priority.
        # PyTorch's streams do not wait for the default stream: the loop's waits once for the
        # state allocated above, and the caller's stream for the loop's after each call.
        self.stream: Any = None
        if config.prefill_stream and decoder.is_cuda:
            low, high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(self.device, priority=high)
            self.passes.side = torch.cuda.Stream(self.device, priority=low)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    # -- the host side -------------------------------------------------------------------------

    @property
    def stats(self) -> LoopStats:
        return self.state.stats

    @property
    def rows(self) -> dict[int, LoopRow]:
        """Slot -> live row."""
        return self.books.rows

    @property
    def live(self) -> int:
        return len(self.rows)

    def idle(self) -> bool:
        return not self.rows and self.passes.pending is None

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """The loop's device work on its own stream (with `prefill_stream` on a GPU), the
        caller's stream ordered after it; elsewhere as it comes."""
        if self.stream is None:
            yield
            return
        import torch

        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Around a run of ticks: no autograd, the loop's stream, its CPU seconds counted, and
        its GPU spans collected after."""
        import torch

        cpu = time.thread_time
        with torch.inference_mode(), self._on_stream():
            c_start = cpu()
            try:
                yield
            finally:
                self.stats.cpu_s += cpu() - c_start
        self.collect_stats()

    def land(self) -> bool:
        """A tick begins: the pending prefill pass committed if done (waited for when nothing
        decodes meanwhile); whether none is pending now, so a plan may admit rows (one pass
        at a time)."""
        self._tick = (time.perf_counter(), time.thread_time())
        return self.passes.pending is None or self.passes.land(wait=not self.rows)

    def execute(
        self, plan: StepPlan, admitted: list[LoopRow], deadline: float | None = None
    ) -> tuple[StepOutput, list[Done]]:
        """Carry a plan out (after `land`): its drops, its prefill pass (`admitted`: the
        rows of `plan.admit` in order, their slots and ranges set), then up to
        `plan.decode_steps` decode steps (each with the lanes' interactive-only steps, or a
        pass's shadow steps) and harvests, stopping early once a row ended, nothing is left on
        the device, or `deadline` (time.monotonic()) passed. The output, and the rows ended."""
        stats, clock, cpu = self.stats, time.perf_counter, time.thread_time
        if plan.drop:
            self._drop(set(plan.drop))
        if admitted:
            self.passes.run(admitted, plan.busy)
            self._pass_launched_at = self.books.step_no
        stats.bulk_held_passes += plan.bulk_held
        first = self.books.step_no
        done: list[Done] = []
        for i in range(plan.decode_steps):
            if i:
                self.land()  # nothing waits: only a pending pass to commit
            t0, c0 = self._tick
            t1 = clock()
            stats.prefill_host_s += t1 - t0
            stats.prefill_cpu_s += cpu() - c0
            if self.rows:
                self._decode()
                t2 = clock()
                done = self.harvest(force=False)
                stats.decode_host_s += t2 - t1
                stats.harvest_host_s += clock() - t2
            if done or self.idle() or (deadline is not None and time.monotonic() >= deadline):
                break
        return self._output(first, done), done

    def harvest_now(self) -> tuple[StepOutput, list[Done]]:
        """The rows ended so far, the slots' state read back now (a run that found none)."""
        t = time.perf_counter()
        done = self.harvest(force=True) if self.rows else []
        self.stats.harvest_host_s += time.perf_counter() - t
        return self._output(self.books.step_no, done), done

    def _output(self, first: int, done: list[Done]) -> StepOutput:
        return StepOutput(self.books.step_no - first, tuple(d.row.key for d in done))

    def _decode(self) -> None:
        """One full decode step and the lanes' steps after it; or, in a side-stream pass's
        shadow, an interactive-only step instead (`_in_pass_shadow`)."""
        if not self._in_pass_shadow():
            self._decode_step()
            self._extra_steps()
        elif self._shadow_room():
            ran = self._extra_steps(limit=1)
            self.stats.pass_steps += ran
            self._shadow_mark()
            if not ran:  # every reserve row at its cap: a full step, not a spin
                self._decode_step()
        else:  # two small steps queued already: the pass and they run meanwhile
            time.sleep(SHADOW_POLL_S)

    def collect_stats(self, wait: bool = False) -> LoopStats:
        """`stats` with the GPU times of every span done so far (all of them with `wait`)."""
        totals = self.state.clock.collect(wait)
        self.stats.prefill_s = totals.get("prefill", 0.0)
        self.stats.lane_prefill_s = totals.get("prefill_lane", 0.0)
        self.stats.extra_decode_s = totals.get("decode_extra", 0.0)
        self.stats.lane_decode_s = totals.get("decode_lane", 0.0) + self.stats.extra_decode_s
        self.stats.prefill_s += self.stats.lane_prefill_s
        self.stats.decode_s = totals.get("decode", 0.0) + self.stats.lane_decode_s
        self.stats.wait_s = self.state.readback.waited_s
        return self.stats

    def clear(self) -> list[LoopRow]:
        """Forget every row (after an error); the rows that were on the device or in a pending
        prefill pass."""
        rows = list(self.rows.values()) + self.passes.discard()
        with self._on_stream():
            for slot in list(self.rows):
                self._release(slot)
        self.graphs.clear()
        self.state.readback.drop()
        return rows

    def _drop(self, keys: Collection[str]) -> list[LoopRow]:
        """Forget these rows (their jobs were cancelled: a plan's `drop`); the rows dropped.

        A live row's slot is freed as a finished row's is, and a copy of the slots' state still
        in flight names it no more (`_ended` skips a slot whose row changed), so it never comes
        back as done. A pending prefill pass holding one of them is committed first: its rows
        are then live."""
        pending = self.passes.pending
        if pending is not None and any(r.key in keys for r in pending.rows):
            self.passes.settle()
        dropped: list[LoopRow] = []
        for slot, row in list(self.rows.items()):
            if row.key in keys:
                self._release(slot)
                dropped.append(row)
        return dropped

    # -- decoding -----------------------------------------------------------------------------

    def _add_extra(self, row: LoopRow) -> None:
        """A token more for a live row, made in an interactive-only step; if that token reached
        its cap, the harvest looks at once."""
        if self.books.add_extra(row):
            self.harvest.track(row)

    def _attention(self, k: int) -> Any:
        """The attention function of a step over the first `k` slots."""
        if self.use_triton:
            from ocrq.models.hunyuan.attention import (
                DEFAULT_CONFIG,
                FP8_CONFIG,
                TritonDecodeAttention,
            )

            if k not in self._kernels:
                config = self.decoder.kernel
                if is_fp8(self.tensors.kv_dtype) and config == DEFAULT_CONFIG:
                    config = replace(FP8_CONFIG, fp8_products=self.config.fp8_products)
                self._kernels[k] = TritonDecodeAttention(
                    k, self.text.heads, self.text.kv_heads, self.text.head_dim,
                    self.config.pool_tokens + 1, self.device, config,
                    padded=self.tensors.values_transposed,
                )
            kernel = self._kernels[k]
            start, end, scale = self.tensors.start[:k], self.tensors.end[:k], self.text.scale

            def triton_attend(q: Any, kc: Any, vc: Any) -> Any:
                shape = (k, *kc.shape[1:])
                return kernel(q, kc.expand(shape), vc.expand(shape), start, end, scale)

            return triton_attend

        from ocrq.models.hunyuan.attention import attend_torch

        assert self.tensors.valid is not None
        valid, scale = self.tensors.valid[:k], self.text.scale

        def torch_attend(q: Any, kc: Any, vc: Any) -> Any:
            shape = (k, *kc.shape[1:])
            return attend_torch(q, kc.expand(shape), vc.expand(shape), valid, scale)

        return torch_attend

    def _launch_step(self, k: int, span: str) -> None:
        """A step over slots [0, k): its graph replayed, else run (and captured)."""
        graphed = self.decoder.use_graph and self.decoder.is_cuda and not self.config.keep_logits
        if graphed and k in self.graphs:
            with self.state.clock.span(span):
                self.graphs[k].replay()
        else:
            with self.state.clock.span(span):
                self.step(k)
            if graphed:
                self.capture(k)

    def _decode_step(self) -> None:
        self._guard()
        k = self.books.bucket()
        lane = self.books.live_interactive > 0
        self._launch_step(k, "decode_lane" if lane else "decode")
        stats, books, live = self.stats, self.books, len(self.rows)
        stats.steps += 1
        stats.slot_steps += k
        stats.row_steps += live
        stats.kv_token_steps += books.kv_base + live * books.step_no + books.kv_extra
        stats.interactive_row_steps += books.live_interactive
        if lane:
            stats.lane_steps += 1
            stats.lane_row_steps += live
        stats.overlap_steps += self.passes.pending is not None
        self.books.step_no += 1
        self.harvest.since_check += 1

    def _reserve_lane(self) -> list[int]:
        """The live interactive rows' slots within the reserve. Only those: an interactive row
        that found the reserve full sits among the bulk rows, and covering it would make each
        interactive-only step a full one (measured on the H200 at 8-13 ms against 2.2,
        bench/results/lanes/lanes_h200_extra2_relaxed.md); it gets its tokens from the full
        steps alone."""
        reserved = self.config.lanes.reserved_slots
        return [s for s in self.books.interactive_slots if not reserved or s < reserved]

    def _in_pass_shadow(self) -> bool:
        """Whether this iteration runs an interactive-only step instead of a full one
        (`LanePolicy.pass_steps`): a pass is pending on the side stream, a row of the reserve
        is live, and a full step has run since the pass was launched (so each pass gets one
        beside it, and back-to-back passes cannot hold the bulk rows back for long)."""
        if not (self.config.lanes.pass_steps and self.config.prefill_stream):
            return False
        if self.passes.pending is None or self.books.step_no == self._pass_launched_at:
            return False
        return bool(self._reserve_lane())

    def _shadow_room(self) -> bool:
        """Whether another step may be queued in a pass's shadow: fewer than
        `SHADOW_IN_FLIGHT` of them unfinished (their events; a CPU runs them at once). The
        host's usual bound (two harvest checks ahead) would queue up to 16, which the full
        step would then wait behind once the pass lands."""
        while self._shadow_events and self._shadow_events[0].query():
            self._shadow_events.popleft()
        return len(self._shadow_events) < SHADOW_IN_FLIGHT

    def _shadow_mark(self) -> None:
        """An event after the step just queued in a pass's shadow (a GPU only)."""
        import torch

        if self.decoder.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._shadow_events.append(event)

    def _extra_steps(self, limit: int | None = None) -> int:
        """After a full step (or, with `limit`, in a pending pass's shadow), while an
        interactive row of the reserve is live: `LanePolicy.extra_steps` (or `limit`) steps
        over the smallest bucket holding every such row (the module's docstring), fewer once
        each of them has surely reached its cap; how many ran. They count as steps everywhere
        a step counts (stats, the harvest's checks), but not in `step_no`, the clock of
        admission (its prefill gaps) and of each row's `first_step`."""
        lanes = self.config.lanes
        slots = self._reserve_lane()
        count = lanes.extra_steps if limit is None else limit
        if not count or not slots:
            return 0
        k = self.books.bucket(max(slots) + 1)
        lane = [self.rows[s] for s in slots]
        stats = self.stats
        ran = 0
        for _ in range(count):
            if all(self.books.made(r) >= r.max_new_tokens for r in lane):
                break
            if self.config.keep_logits:
                self.harvest.keep_logits()  # the previous step's, before this one's replace it
            covered = [r for s in range(k) if (r := self.rows.get(s)) is not None]
            self._guard([r.slot for r in covered])
            self._launch_step(k, "decode_extra")
            stats.steps += 1
            stats.extra_steps += 1
            stats.slot_steps += k
            stats.row_steps += len(covered)
            step_no = self.books.step_no
            stats.kv_token_steps += sum(r.prompt_tokens - r.first_step + step_no + r.extra
                                        for r in covered)
            stats.interactive_row_steps += len(lane)
            stats.lane_steps += 1
            stats.lane_row_steps += len(covered)
            stats.overlap_steps += self.passes.pending is not None
            for r in covered:
                self._add_extra(r)
            self.harvest.since_check += 1
            ran += 1
        return ran

    def capture(self, k: int) -> None:
        """Record the step over `k` slots (recorded, not run: its first step ran eagerly just
        before, which also warmed its kernels up)."""
        import torch

        t = time.perf_counter()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self.step(k)
        torch.cuda.synchronize(self.device)
        self.graphs[k] = graph
        self.stats.graphs += 1
        self.stats.capture_s += time.perf_counter() - t

    def step(self, k: int) -> None:
        """One decode step over slots [0, k): fixed shapes, no host sync, no data-dependent
        Python. Slots without a live row (finished, or empty) read and write the scratch
        column and keep their state."""
        import torch

        t = self.tensors
        live = ~t.finished[:k]
        col = torch.where(live, t.write[:k], t.scratch_col)
        t.start[:k].copy_(torch.where(live, t.base[:k], t.scratch_col.int()))
        t.end[:k].copy_(col.int() + 1)
        if t.valid is not None:
            t.valid[:k].scatter_(1, col[:, None], True)
        if self.fused_steps is not None and self.fused_steps.serves(k):
            logits = self.fused_steps(k, t.tok[:k], t.pos[:, :k], col, t.start[:k], t.end[:k],
                                      t.keys, t.values)
        else:
            logits = self.text.step(
                t.tok[:k], t.pos[:, :k], col, t.keys, t.values, self._attention(k),
                self.decoder.fused, pooled=True,
            )
        if self.config.keep_logits:  # a copy: the fused step's logits are one reused buffer
            t.kept = logits.to(torch.float32, copy=True)
        if self.fused_greedy:
            seen = t.seen[:k] if t.seen is not None else None
            nxt = greedy_next(logits, seen, self.config.penalty, t.count[:k], t.min_new[:k], t.eos)
        else:
            nxt = t.scores(logits, None).argmax(-1)
        if t.forced is not None:  # hooks only: captured in the graph with the rest
            nxt = t.forced.step(nxt, t.count[:k])
        nxt = torch.where(live, nxt, torch.full_like(nxt, self.tokens.pad))
        at = t.count[:k].clamp(max=t.out.shape[1] - 1)[:, None]
        kept = t.out[:k].gather(1, at)[:, 0]
        t.out[:k].scatter_(1, at, torch.where(live, nxt, kept)[:, None])
        t.count[:k] += live
        ended = (nxt[:, None] == t.eos[None, :]).any(1) | (t.count[:k] >= t.cap[:k])
        t.finished[:k] |= live & ended
        t.tok[:k].copy_(torch.where(live, nxt, t.tok[:k]))
        t.pos[:, :k] += live
        t.write[:k] += live
        if t.seen is not None:
            t.seen[:k].scatter_(1, nxt[:, None], live[:, None] | t.seen[:k].gather(
                1, nxt[:, None]))

    def _guard(self, slots: Collection[int] | None = None) -> None:
        """Stop the live rows whose tokens so far end in a loop, at the token counts the static
        loop checks (`guard_due`); the host knows each row's count without a sync (a live row
        makes one token in each step that covers it: `LoopBooks.made`). Before a full step, the
        rows of this step's phase; before an interactive-only step, the `slots` it covers."""
        import torch

        if self._finder is None:
            return
        guard = self._finder.guard
        due: dict[int, list[int]] = {}
        # Rows whose eos the hooks force never enter a phase: their length is the hooks' call.
        if slots is None:
            slots = self.books.phases.get(self.books.step_no % guard.every, ())
        for slot in slots:
            row = self.rows[slot]
            if row.eos_at is not None:
                continue
            n = self.books.made(row)
            if guard_due(guard, n, row.min_new_tokens, row.max_new_tokens):
                due.setdefault(n, []).append(slot)
        for n, slots in due.items():
            index = to_device(slots, torch.long, self.device)
            t = self.tensors
            hits = self._finder(t.out[index, :n]) & ~t.finished[index]
            t.stopped.index_copy_(0, index, torch.where(hits, n, t.stopped[index]))
            t.finished.index_copy_(0, index, t.finished[index] | hits)

    # -- finished rows ---------------------------------------------------------------------------

    def _ended(self, snap: Snapshot) -> list[Done]:
        """The rows finished in `snap` that still hold their slots; released."""
        self.stats.readbacks += 1
        done = []
        for slot, row in snap.rows.items():
            if not snap.finished[slot] or self.rows.get(slot) is not row:
                continue
            n = snap.counts[slot]
            logits = None
            if self.config.keep_logits:
                import torch

                logits = torch.stack(row.logits)
            done.append(Done(row, snap.out[slot, :n].tolist(), int(snap.stopped[slot]), logits))
            self._release(slot)
        return done

    def _release(self, slot: int) -> None:
        self.books.leave(slot)
        self.tensors.free(slot)
