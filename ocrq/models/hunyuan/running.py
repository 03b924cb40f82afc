"""The fast loop as a running loop: a fixed set of slots, rows leaving and joining between steps.

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
  lowest above the lane's reserve: ocrq/models/lane_pass.py);
* the Triton decode kernel reads row r's keys [start_r, end_r) of the pool expanded over the
  rows (batch stride 0); the torch reference reads the pool under a per-slot mask, which admission
  clears (`_forget_keys`) before a new row's prompt is marked: the tests show that skipping that
  clear lets an old row's keys leak into the new one.

Split as vLLM splits its scheduler from its runner, at ocrq's scale: the loop here keeps the
device state (the pool, every per-slot tensor, the graphs) and its books of rows, chooses tokens
and runs the decode steps; its collaborators are the admission policy, which says when to
prefill and which rows (ocrq/models/hunyuan/admission.py: the prefill schedules,
`LoopConfig.schedule`), the prefill passes that carry a plan out on the loop's state
(ocrq/models/hunyuan/passes.py), and the harvest, which says when the slots' state is read back
for the rows that ended (ocrq/models/hunyuan/harvest.py).

The greedy arithmetic (scores, repetition penalty, eos ban, the guard's rule) is the static
loop's, per row; a row's tokens do not depend on the rows beside it (tests).

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
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.admission import AdmissionPolicy
from ocrq.models.hunyuan.attention import PAD_KEYS
from ocrq.models.hunyuan.greedy import greedy_next, greedy_scores
from ocrq.models.hunyuan.harvest import Harvest
from ocrq.models.hunyuan.hooks import DecodeHooks, ForcedEos
from ocrq.models.hunyuan.inputs import EncodedImage
from ocrq.models.hunyuan.kv_cache import is_fp8, kv_dtype, padded_width, zero_pool
from ocrq.models.hunyuan.passes import PrefillPasses
from ocrq.models.hunyuan.readback import GpuClock, Readback, Snapshot, to_device
from ocrq.models.hunyuan.repetition import LoopFinder, guard_due
from ocrq.models.hunyuan.tokens import SpecialTokens
from ocrq.models.hunyuan.versions import RepetitionGuard
from ocrq.models.lane_pass import LanePolicy
from ocrq.models.slots import KvPool, capacity_of

if TYPE_CHECKING:
    import torch

    from ocrq.models.hunyuan.decode import HunyuanDecoder

log = logging.getLogger(__name__)

SCHEDULES = ("alternate", "chunked")
BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # graphed slot counts
# Interactive-only steps queued at once in a side-stream pass's shadow (`LanePolicy.pass_steps`),
# and how long the loop thread sleeps when that many are: two keep the loop's stream busy
# while the host launches the next; each ~1.5-2 ms on a Hopper GPU.
SHADOW_IN_FLIGHT = 2
SHADOW_POLL_S = 0.0002


# An fp8 pool's values stored transposed (see the module's docstring). A constant, not a
# setting: bench/service_gpu.py flips it (BENCH_FP8_VALUES) to compare both layouts in one run.
FP8_VALUES_TRANSPOSED = True
# The decode step's greedy choice by Triton kernels where the loop's attention is Triton's
# (ocrq/models/hunyuan/greedy.py; the same tokens as `_scores` + argmax). A constant, not a
# setting: bench/loop_profile.py flips it (--greedy torch) to time both in one call.
FUSED_GREEDY = True

@dataclass
class LoopRow:
    """One image in the running loop. `max_new_tokens` is the row's own cap (at most the loop's):
    the row ends there as it would at an eos (`truncated="max_tokens"`)."""

    key: str
    encoded: EncodedImage
    max_new_tokens: int
    min_new_tokens: int = 0  # eos banned before this many tokens (benches force lengths)
    interactive: bool = False  # the job's lane (ocrq/models/lane_pass.py)
    # Set by the loop.
    # The loop's hooks' token index at which the row takes eos (ocrq/models/hunyuan/hooks.py);
    # None: the model's own choice (always, without hooks).
    eos_at: int | None = None
    queued_step: int = 0  # the loop's decode steps when it joined the queue
    slot: int = -1
    start: int = -1
    capacity: int = 0
    first_step: int = 0  # the loop's decode steps before its prefill: tokens = steps since + 1
    extra: int = 0  # ... + the tokens it made in interactive-only steps (the module's docstring)
    admitted_at: float = 0.0
    # Which entry of the slot this is (the loop counts entries): the harvest's cap heap names a
    # row by it, where an `id()` could be a freed row's reused by a later one.
    entry: int = -1
    logits: list[Any] = field(default_factory=list)  # raw logits per token, when kept (tests)

    @property
    def prompt_tokens(self) -> int:
        return int(self.encoded.input_ids.shape[0])


@dataclass
class Done:
    """A finished row: its generated ids (eos included when it ended on one), how many the
    repetition guard kept (0: not stopped), and its logits when kept."""

    row: LoopRow
    tokens: list[int]
    stopped: int
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class LoopConfig:
    slots: int
    pool_tokens: int
    max_new_tokens: int
    schedule: str = "chunked"
    prefill_tokens: int = 16384  # prompt tokens of one prefill pass ("alternate")
    chunk_tokens: int = 4096  # ... of one chunk between decode steps ("chunked")
    # "chunked": decode steps between prefill passes, unless a pass is full or nothing runs.
    # A pass costs its host time (the vision tower and every layer launched from Python)
    # whatever it holds, so waiting a few steps for more rows makes fewer, fuller passes.
    prefill_gap: int = 1
    check_every: int = 8  # decode steps between copies of the slots' state to the host
    penalty: float = 1.0
    guard: RepetitionGuard | None = None
    keep_logits: bool = False  # tests: every token's raw logits per row (a host sync per step)
    # The pool's dtype: "auto" (the model's) or "fp8" (ocrq/models/hunyuan/kv_cache.py).
    kv_dtype: str = "auto"
    # An fp8 pool's decode products in e4m3 (KernelConfig.fp8_products).
    fp8_products: bool = False
    # Prefill passes with the rows packed end to end, no padding (ocrq/models/hunyuan/packed.py):
    # a pass then costs the tokens it holds, not rows x the longest prompt.
    packed: bool = False
    # The interactive lane (ocrq/models/lane_pass.py): reserved slots, bulk limits while busy.
    lanes: LanePolicy = field(default_factory=LanePolicy)
    # Prefill passes on a side stream of low priority, committed once done, while decode steps
    # go on on the loop's own stream of high priority (ocrq/models/hunyuan/passes.py). On a CPU
    # the pass is launched at once and committed at a later iteration (tests).
    prefill_stream: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if (self.slots < 1 or self.pool_tokens < 1 or self.max_new_tokens < 1
                or self.prefill_gap < 1):
            raise ValueError(f"invalid loop config {self}")

    @property
    def pass_tokens(self) -> int:
        return self.prefill_tokens if self.schedule == "alternate" else self.chunk_tokens


@dataclass
class LoopStats:
    """Where the loop's time went (seconds of GPU time on a GPU, from events read once done;
    host seconds on a CPU) and what it did; the bench and the worker's metrics read it. With
    `LoopConfig.prefill_stream` prefill and decode spans overlap: their sum can exceed the wall
    time."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    prefills: int = 0
    prefilled_rows: int = 0
    steps: int = 0
    row_steps: int = 0  # live rows summed over steps: the useful share of slot-steps
    slot_steps: int = 0  # slots stepped (the bucket) summed over steps
    graphs: int = 0
    readbacks: int = 0  # copies of the slots' state read by the host
    # The loop thread's own seconds (perf_counter): admitting and launching prefill passes,
    # launching decode steps, reading finished rows, and of that last, waiting for a copy to
    # land. With little waiting and the rest near the wall time, the host is what limits the
    # GPU (bench/service_gpu.py reads them side by side with the GPU seconds above).
    prefill_host_s: float = 0.0
    decode_host_s: float = 0.0
    harvest_host_s: float = 0.0
    wait_s: float = 0.0
    # The loop thread's CPU seconds (thread_time) in prefill passes and in all of `run`: well
    # under the host seconds above, the thread waited (for the GIL, or a full launch queue)
    # rather than worked.
    prefill_cpu_s: float = 0.0
    cpu_s: float = 0.0
    # The lanes (ocrq/models/lane_pass.py). "Busy": an interactive row live or waiting. An
    # interactive row's token costs (lane_decode_s + lane_prefill_s) / lane_steps: the step over
    # every live row plus the prefill passes run between its steps; `kv_token_steps` (live KV
    # tokens summed over steps) over `steps` says how much KV a step reads.
    prefill_tokens: int = 0  # prompt tokens prefilled
    prefilled_interactive: int = 0
    lane_steps: int = 0  # decode steps with an interactive row live
    lane_row_steps: int = 0  # live rows summed over those steps
    interactive_row_steps: int = 0  # live interactive rows summed over steps
    kv_token_steps: int = 0
    lane_decode_s: float = 0.0  # GPU seconds of the lane's steps (part of decode_s)
    lane_prefill_s: float = 0.0  # ... of prefill passes run while busy (part of prefill_s)
    lane_prefills: int = 0
    lane_prefill_tokens: int = 0
    bulk_held_passes: int = 0  # passes that held bulk rows back for the lane
    # Interactive-only steps (`LanePolicy.extra_steps`): counted in `steps`, `lane_steps` and
    # the per-row figures above too (each gives every live interactive row a token, as a full
    # step does, so the lane's token cost above stays GPU time per interactive token); their
    # GPU seconds are part of lane_decode_s.
    extra_steps: int = 0
    extra_decode_s: float = 0.0
    pass_steps: int = 0  # of those, run in a side-stream pass's shadow (`LanePolicy.pass_steps`)
    # Prefill passes on a side stream (`LoopConfig.prefill_stream`): their GPU spans overlap
    # the decode steps', so prefill_s + decode_s can exceed the wall time. Passes committed at
    # a later loop iteration than launched, the iterations that found a pass not done yet, and
    # the decode steps run while one was pending (the overlap).
    late_passes: int = 0
    pending_iterations: int = 0
    overlap_steps: int = 0


class RunningLoop:
    """Slots, a KV pool and the rows in them, for one loaded model on one device."""

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
        self.stats = LoopStats()
        self.waiting: deque[LoopRow] = deque()
        self.rows: dict[int, LoopRow] = {}  # slot -> live row
        self.pool = KvPool.empty(config.pool_tokens)
        self.graphs: dict[int, Any] = {}
        self._graph_pool: Any = None
        self._kernels: dict[int, Any] = {}
        self._finder = (
            LoopFinder(config.guard, self.device) if config.guard is not None else None
        )
        s, n, dev = config.slots, config.max_new_tokens, self.device
        text = self.text
        self.scratch = config.pool_tokens  # the column every slot without a live row uses
        width = padded_width(config.pool_tokens + 1, PAD_KEYS)
        self.kv_dtype = kv_dtype(config.kv_dtype, text.dtype)
        self.values_transposed = is_fp8(self.kv_dtype) and FP8_VALUES_TRANSPOSED
        heads, dim, kv = text.kv_heads, text.head_dim, self.kv_dtype
        self.keys = [zero_pool(heads, width, dim, kv, dev) for _ in text.layers]
        self.values = [zero_pool(heads, width, dim, kv, dev, transposed=self.values_transposed)
                       for _ in text.layers]
        self.use_triton = decoder.attention == "triton"
        self.fused_greedy = self.use_triton and FUSED_GREEDY
        self.track_valid = not self.use_triton
        # The torch attention's per-slot key mask; the Triton kernel reads [start, end) instead.
        self.valid = (
            torch.zeros(s, width, dtype=torch.bool, device=dev) if self.track_valid else None
        )
        long = torch.long
        self.tok = torch.full((s,), tokens.pad, dtype=long, device=dev)
        self.pos = torch.zeros(text.axes, s, dtype=long, device=dev)
        self.write = torch.full((s,), self.scratch, dtype=long, device=dev)
        self.start = torch.full((s,), self.scratch, dtype=torch.int32, device=dev)
        self.end = torch.full((s,), self.scratch + 1, dtype=torch.int32, device=dev)
        self.base = torch.full((s,), self.scratch, dtype=torch.int32, device=dev)
        self.count = torch.zeros(s, dtype=long, device=dev)
        self.cap = torch.ones(s, dtype=long, device=dev)
        self.min_new = torch.zeros(s, dtype=long, device=dev)
        self.finished = torch.ones(s, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(s, dtype=long, device=dev)
        self.out = torch.full((s, n), tokens.pad, dtype=long, device=dev)
        self.eos = torch.tensor(tokens.eos_list, dtype=long, device=dev)
        self.forced = ForcedEos(s, n + 1, self.eos) if hooks is not None else None
        vocab = int(text.lm_head.weight.shape[0])
        self.seen = (
            torch.zeros(s, vocab, dtype=torch.bool, device=dev) if config.penalty != 1.0 else None
        )
        self.scratch_col = torch.tensor([self.scratch], dtype=long, device=dev)
        self._true = torch.ones((), dtype=torch.bool, device=dev)
        self._step_no = 0  # decode steps run so far
        self._entries = 0  # rows that entered a slot so far (LoopRow.entry)
        self._pass_launched_at = -1  # `_step_no` when the last prefill pass was launched
        self._shadow_events: deque[Any] = deque()  # steps queued in a pass's shadow, unfinished
        # The lanes' books (ocrq/models/lane_pass.py), kept by add/_take_waiting/_enter/_release.
        self._live_interactive = 0
        self._waiting_interactive = 0
        self._kv_base = 0  # sum over live rows of prompt - first_step (live KV, O(1) a step)
        self._kv_extra = 0  # sum over live rows of `extra`
        self._interactive_slots: set[int] = set()  # slots of live interactive rows
        # Rows due a repetition check, by phase: rows admitted at steps congruent mod `every`
        # are due at the same steps, so a step looks at its own phase only.
        self._phases: dict[int, set[int]] = {}
        self.readback = Readback(s, n, dev)
        self.clock = GpuClock(bool(decoder.is_cuda))
        # Its collaborators: which rows to prefill and when, the passes that prefill them, and
        # when to read the slots' state back for the rows that ended.
        self.admission = AdmissionPolicy(self)
        self.passes = PrefillPasses(self)
        self.harvest = Harvest(self)
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
    def live(self) -> int:
        return len(self.rows)

    def idle(self) -> bool:
        return not self.rows and not self.waiting and self.passes.pending is None

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

    def add(self, rows: Sequence[LoopRow]) -> None:
        """Queue rows, oldest first; each must fit the pool alone (the planner's check)."""
        for row in rows:
            if not 1 <= row.max_new_tokens <= self.config.max_new_tokens:
                raise ValueError(
                    f"row {row.key}: max_new_tokens {row.max_new_tokens} outside "
                    f"1..{self.config.max_new_tokens}"
                )
            row.capacity = capacity_of(row.prompt_tokens, row.max_new_tokens)
            row.eos_at = self.hooks.eos_at(row.key) if self.hooks is not None else None
            if row.capacity > self.config.pool_tokens:
                raise ValueError(
                    f"row {row.key} needs {row.capacity} KV tokens, over the pool's "
                    f"{self.config.pool_tokens}"
                )
            row.queued_step = self._step_no
            self._waiting_interactive += row.interactive
            self.waiting.append(row)

    def run(self, timeout_s: float | None = None) -> list[Done]:
        """Run until at least one row finishes (returning those finished since the last call),
        nothing is left, or `timeout_s` passes."""
        import torch

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        done: list[Done] = []
        cpu = time.thread_time
        with torch.inference_mode(), self._on_stream():
            stats, clock = self.stats, time.perf_counter
            c_start = cpu()
            while not done and not self.idle():
                t0, c0 = clock(), cpu()
                self._refill()
                t1 = clock()
                stats.prefill_host_s += t1 - t0
                stats.prefill_cpu_s += cpu() - c0
                if self.rows:
                    if not self._in_pass_shadow():
                        self._decode_step()
                        self._extra_steps()
                    elif self._shadow_room():
                        ran = self._extra_steps(limit=1)
                        stats.pass_steps += ran
                        self._shadow_mark()
                        if not ran:  # every reserve row at its cap: a full step, not a spin
                            self._decode_step()
                    else:  # two small steps queued already: the pass and they run meanwhile
                        time.sleep(SHADOW_POLL_S)
                    t2 = clock()
                    done = self.harvest(force=False)
                    stats.decode_host_s += t2 - t1
                    stats.harvest_host_s += clock() - t2
                if deadline is not None and time.monotonic() >= deadline:
                    break
            if not done and self.rows:
                t = clock()
                done = self.harvest(force=True)
                stats.harvest_host_s += clock() - t
            stats.cpu_s += cpu() - c_start
        self.collect_stats()
        return done

    def drain(self) -> list[Done]:
        """Every row queued, run to its end (tests and the bench)."""
        done: list[Done] = []
        while not self.idle():
            done += self.run()
        self.collect_stats(wait=True)
        return done

    def warm_up(self, row: LoopRow | None, deadline: float) -> list[int]:
        """Before the first job: `row` run through, or (None) every bucket's step captured by
        `deadline` (ocrq/models/hunyuan/warm_up.py); the buckets graphed."""
        from ocrq.models.hunyuan.warm_up import warm_up

        return warm_up(self, row, deadline)

    def collect_stats(self, wait: bool = False) -> LoopStats:
        """`stats` with the GPU times of every span done so far (all of them with `wait`)."""
        totals = self.clock.collect(wait)
        self.stats.prefill_s = totals.get("prefill", 0.0)
        self.stats.lane_prefill_s = totals.get("prefill_lane", 0.0)
        self.stats.extra_decode_s = totals.get("decode_extra", 0.0)
        self.stats.lane_decode_s = totals.get("decode_lane", 0.0) + self.stats.extra_decode_s
        self.stats.prefill_s += self.stats.lane_prefill_s
        self.stats.decode_s = totals.get("decode", 0.0) + self.stats.lane_decode_s
        self.stats.wait_s = self.readback.waited_s
        return self.stats

    def clear(self) -> list[LoopRow]:
        """Forget every row (after an error); the rows that were in flight, in a pending
        prefill pass or waiting."""
        rows = list(self.rows.values()) + self.passes.discard() + list(self.waiting)
        with self._on_stream():
            for slot in list(self.rows):
                self._release(slot)
        self.waiting.clear()
        self._waiting_interactive = 0
        self.graphs.clear()
        self.readback.drop()
        return rows

    def drop(self, keys: Collection[str]) -> list[LoopRow]:
        """Forget these rows (their jobs were cancelled), waiting or live; the rows dropped.

        Called between `run`s, right after a harvest: a live row's slot and KV range are freed
        as a finished row's are, and a copy of the slots' state still in flight names it no
        more (`_ended` skips a slot whose row changed), so it never comes back as done. A
        pending prefill pass holding one of them is committed first: its rows are then live.
        """
        if not keys:
            return []
        import torch

        with torch.inference_mode(), self._on_stream():
            return self._drop(keys)

    def _drop(self, keys: Collection[str]) -> list[LoopRow]:
        pending = self.passes.pending
        if pending is not None and any(r.key in keys for r in pending.rows):
            self.passes.settle()
        dropped = [row for row in self.waiting if row.key in keys]
        if dropped:
            self.waiting = deque(row for row in self.waiting if row.key not in keys)
            self._waiting_interactive -= sum(row.interactive for row in dropped)
        for slot, row in list(self.rows.items()):
            if row.key in keys:
                self._release(slot)
                dropped.append(row)
        return dropped

    def _bucket(self, top: int | None = None) -> int:
        """Slots a step runs over: the smallest bucket covering the highest live slot (or the
        first `top` slots)."""
        top = max(self.rows) + 1 if top is None else top
        for b in BUCKETS:
            if b >= top:
                return min(b, self.config.slots)
        return self.config.slots

    # -- admission ----------------------------------------------------------------------------

    def _refill(self) -> None:
        """The pending pass committed if done (waited for when nothing decodes meanwhile), then
        the pass the admission policy plans before this step, if any, run now."""
        if self.passes.pending is not None and not self.passes.land(wait=not self.rows):
            return
        plan = self.admission.plan()
        if plan is not None:
            self.passes.run(plan)
            self._pass_launched_at = self._step_no

    def _take_waiting(self, keys: list[str]) -> list[LoopRow]:
        """The rows of `keys` out of the queue, in that order (a prefill pass's plan): a pass
        may take interactive rows from behind bulk ones."""
        if all(r.key == k for r, k in zip(self.waiting, keys, strict=False)):  # the oldest
            rows = [self.waiting.popleft() for _ in keys]
        else:
            wanted = set(keys)
            by_key = {r.key: r for r in self.waiting if r.key in wanted}
            self.waiting = deque(r for r in self.waiting if r.key not in wanted)
            rows = [by_key[k] for k in keys]
        self._waiting_interactive -= sum(r.interactive for r in rows)
        return rows

    def _enter(self, row: LoopRow) -> None:
        """The host's books for a row now in its slot: when its cap is reached, its guard phase."""
        self.rows[row.slot] = row
        row.entry, self._entries = self._entries, self._entries + 1
        self._live_interactive += row.interactive
        if row.interactive:
            self._interactive_slots.add(row.slot)
        self._kv_base += row.prompt_tokens - row.first_step
        self._kv_extra += row.extra
        self.harvest.track(row)
        phase = self._phase(row)
        if phase is not None:
            self._phases.setdefault(phase, set()).add(row.slot)

    def _made(self, row: LoopRow) -> int:
        """The tokens a live row has made so far, as the host knows without a sync (an upper
        bound once it ended: a finished row makes no more)."""
        return self._step_no - row.first_step + 1 + row.extra

    def _phase(self, row: LoopRow) -> int | None:
        """The full steps (mod the guard's `every`) before which the row's count is a multiple
        of `every`; None: the guard never checks it (no guard, or the hooks force its eos)."""
        if self._finder is None or row.eos_at is not None:
            return None
        return (row.first_step - 1 - row.extra) % self._finder.guard.every

    def _add_extra(self, row: LoopRow) -> None:
        """A token more for a live row, made in an interactive-only step: its guard phase moves
        and, if that token reached its cap, the harvest looks at once."""
        phase = self._phase(row)
        if phase is not None:
            self._phases[phase].discard(row.slot)
        row.extra += 1
        self._kv_extra += 1
        phase = self._phase(row)
        if phase is not None:
            self._phases.setdefault(phase, set()).add(row.slot)
        if self._made(row) == row.max_new_tokens:
            self.harvest.track(row)

    def _forget_keys(self, slot: int) -> None:
        """No key of the slot's previous row stays visible to the next one (the torch mask;
        the Triton kernel reads [start, end), reset for the new row)."""
        if self.valid is not None:
            self.valid[slot].fill_(False)

    # -- choosing tokens ------------------------------------------------------------------------

    def _scores(self, logits: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """Float32 scores as transformers' processors make them, for the rows at `slots` (None:
        the first rows, as many as `logits` has)."""
        n = logits.shape[0]
        seen = self.seen if slots is None or self.seen is None else self.seen[slots]
        count = self.count if slots is None else self.count[slots]
        min_new = self.min_new if slots is None else self.min_new[slots]
        return greedy_scores(
            logits, None if seen is None else seen[:n], self.config.penalty, count[:n],
            min_new[:n], self.eos,
        )

    def _choose(self, logits: torch.Tensor, slots: torch.Tensor, rows: list[LoopRow]) -> None:
        """The first token of freshly prefilled rows (at `slots`), as the static loop's."""
        scores = self._scores(logits, slots)
        nxt = scores.argmax(-1)
        if self.forced is not None:
            nxt = self.forced.first(nxt, slots)
        if self.config.keep_logits:
            for i, r in enumerate(rows):
                r.logits = [logits[i].float().cpu()]
        self.out[:, 0].index_copy_(0, slots, nxt)
        self.tok.index_copy_(0, slots, nxt)
        ended = (nxt[:, None] == self.eos[None, :]).any(1)
        self.count.index_fill_(0, slots, 1)
        ended |= self.cap[slots] <= 1
        self.finished.index_copy_(0, slots, ended)
        if self.seen is not None:  # a device True: `= True` would copy a host scalar (a sync)
            self.seen.index_put_((slots, nxt), self._true)

    # -- decoding -----------------------------------------------------------------------------

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
                if is_fp8(self.kv_dtype) and config == DEFAULT_CONFIG:
                    config = replace(FP8_CONFIG, fp8_products=self.config.fp8_products)
                self._kernels[k] = TritonDecodeAttention(
                    k, self.text.heads, self.text.kv_heads, self.text.head_dim,
                    self.config.pool_tokens + 1, self.device, config,
                    padded=self.values_transposed,
                )
            kernel = self._kernels[k]
            start, end, scale = self.start[:k], self.end[:k], self.text.scale

            def triton_attend(q: Any, kc: Any, vc: Any) -> Any:
                shape = (k, *kc.shape[1:])
                return kernel(q, kc.expand(shape), vc.expand(shape), start, end, scale)

            return triton_attend

        from ocrq.models.hunyuan.attention import attend_torch

        assert self.valid is not None
        valid, scale = self.valid[:k], self.text.scale

        def torch_attend(q: Any, kc: Any, vc: Any) -> Any:
            shape = (k, *kc.shape[1:])
            return attend_torch(q, kc.expand(shape), vc.expand(shape), valid, scale)

        return torch_attend

    def _launch_step(self, k: int, span: str) -> None:
        """A step over slots [0, k): its graph replayed, else run (and captured)."""
        graphed = self.decoder.use_graph and self.decoder.is_cuda and not self.config.keep_logits
        if graphed and k in self.graphs:
            with self.clock.span(span):
                self.graphs[k].replay()
        else:
            with self.clock.span(span):
                self._step(k)
            if graphed:
                self._capture(k)

    def _decode_step(self) -> None:
        self._guard()
        k = self._bucket()
        lane = self._live_interactive > 0
        self._launch_step(k, "decode_lane" if lane else "decode")
        stats, live = self.stats, len(self.rows)
        stats.steps += 1
        stats.slot_steps += k
        stats.row_steps += live
        stats.kv_token_steps += self._kv_base + live * self._step_no + self._kv_extra
        stats.interactive_row_steps += self._live_interactive
        if lane:
            stats.lane_steps += 1
            stats.lane_row_steps += live
        stats.overlap_steps += self.passes.pending is not None
        self._step_no += 1
        self.harvest.since_check += 1

    def _reserve_lane(self) -> list[int]:
        """The live interactive rows' slots within the reserve. Only those: an interactive row
        that found the reserve full sits among the bulk rows, and covering it would make each
        interactive-only step a full one (measured on the H200 at 8-13 ms against 2.2,
        bench/results/lanes/lanes_h200_extra2_relaxed.md); it gets its tokens from the full
        steps alone."""
        reserved = self.config.lanes.reserved_slots
        return [s for s in self._interactive_slots if not reserved or s < reserved]

    def _in_pass_shadow(self) -> bool:
        """Whether this iteration runs an interactive-only step instead of a full one
        (`LanePolicy.pass_steps`): a pass is pending on the side stream, a row of the reserve
        is live, and a full step has run since the pass was launched (so each pass gets one
        beside it, and back-to-back passes cannot hold the bulk rows back for long)."""
        if not (self.config.lanes.pass_steps and self.config.prefill_stream):
            return False
        if self.passes.pending is None or self._step_no == self._pass_launched_at:
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
        a step counts (stats, the harvest's checks), but not in `_step_no`, the clock of
        admission (gaps, promotion) and of each row's `first_step`."""
        lanes = self.config.lanes
        slots = self._reserve_lane()
        count = lanes.extra_steps if limit is None else limit
        if not count or not slots:
            return 0
        k = self._bucket(max(slots) + 1)
        lane = [self.rows[s] for s in slots]
        stats = self.stats
        ran = 0
        for _ in range(count):
            if all(self._made(r) >= r.max_new_tokens for r in lane):
                break
            if self.config.keep_logits:
                self.harvest._keep_logits()  # the previous step's, before this one's replace it
            covered = [r for s in range(k) if (r := self.rows.get(s)) is not None]
            self._guard([r.slot for r in covered])
            self._launch_step(k, "decode_extra")
            stats.steps += 1
            stats.extra_steps += 1
            stats.slot_steps += k
            stats.row_steps += len(covered)
            stats.kv_token_steps += sum(r.prompt_tokens - r.first_step + self._step_no + r.extra
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

    def _capture(self, k: int) -> None:
        """Record the step over `k` slots (recorded, not run: its first step ran eagerly just
        before, which also warmed its kernels up)."""
        import torch

        t = time.perf_counter()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._step(k)
        torch.cuda.synchronize(self.device)
        self.graphs[k] = graph
        self.stats.graphs += 1
        self.stats.capture_s += time.perf_counter() - t

    def _step(self, k: int) -> None:
        """One decode step over slots [0, k): fixed shapes, no host sync, no data-dependent
        Python. Slots without a live row (finished, or empty) read and write the scratch
        column and keep their state."""
        import torch

        live = ~self.finished[:k]
        col = torch.where(live, self.write[:k], self.scratch_col)
        self.start[:k].copy_(torch.where(live, self.base[:k], self.scratch_col.int()))
        self.end[:k].copy_(col.int() + 1)
        if self.valid is not None:
            self.valid[:k].scatter_(1, col[:, None], True)
        logits = self.text.step(
            self.tok[:k], self.pos[:, :k], col, self.keys, self.values, self._attention(k),
            self.decoder.fused, pooled=True,
        )
        if self.config.keep_logits:
            self._kept = logits.float()
        if self.fused_greedy:
            seen = self.seen[:k] if self.seen is not None else None
            nxt = greedy_next(logits, seen, self.config.penalty, self.count[:k],
                              self.min_new[:k], self.eos)
        else:
            nxt = self._scores(logits, None).argmax(-1)
        if self.forced is not None:  # hooks only: captured in the graph with the rest
            nxt = self.forced.step(nxt, self.count[:k])
        nxt = torch.where(live, nxt, torch.full_like(nxt, self.tokens.pad))
        at = self.count[:k].clamp(max=self.out.shape[1] - 1)[:, None]
        kept = self.out[:k].gather(1, at)[:, 0]
        self.out[:k].scatter_(1, at, torch.where(live, nxt, kept)[:, None])
        self.count[:k] += live
        ended = (nxt[:, None] == self.eos[None, :]).any(1) | (self.count[:k] >= self.cap[:k])
        self.finished[:k] |= live & ended
        self.tok[:k].copy_(torch.where(live, nxt, self.tok[:k]))
        self.pos[:, :k] += live
        self.write[:k] += live
        if self.seen is not None:
            self.seen[:k].scatter_(1, nxt[:, None], live[:, None] | self.seen[:k].gather(
                1, nxt[:, None]))

    def _guard(self, slots: Collection[int] | None = None) -> None:
        """Stop the live rows whose tokens so far end in a loop, at the token counts the static
        loop checks (`guard_due`); the host knows each row's count without a sync (a live row
        makes one token in each step that covers it: `_made`). Before a full step, the rows of
        this step's phase; before an interactive-only step, the `slots` it covers."""
        import torch

        if self._finder is None:
            return
        guard = self._finder.guard
        due: dict[int, list[int]] = {}
        # Rows whose eos the hooks force never enter a phase: their length is the hooks' call.
        if slots is None:
            slots = self._phases.get(self._step_no % guard.every, ())
        for slot in slots:
            row = self.rows[slot]
            if row.eos_at is not None:
                continue
            n = self._made(row)
            if guard_due(guard, n, row.min_new_tokens, row.max_new_tokens):
                due.setdefault(n, []).append(slot)
        for n, slots in due.items():
            index = to_device(slots, torch.long, self.device)
            hits = self._finder(self.out[index, :n]) & ~self.finished[index]
            self.stopped.index_copy_(0, index, torch.where(hits, n, self.stopped[index]))
            self.finished.index_copy_(0, index, self.finished[index] | hits)

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
        row = self.rows.pop(slot)
        self._live_interactive -= row.interactive
        self._interactive_slots.discard(slot)
        self._kv_base -= row.prompt_tokens - row.first_step
        self._kv_extra -= row.extra
        phase = self._phase(row)
        if phase is not None:
            self._phases.get(phase, set()).discard(slot)
        self.pool = self.pool.give(row.start, row.capacity)
        # fill_ on a slice: `tensor[slot] = value` copies a host scalar, a sync per row.
        self.finished[slot : slot + 1].fill_(True)
        self.write[slot : slot + 1].fill_(self.scratch)
        self.base[slot : slot + 1].fill_(self.scratch)
