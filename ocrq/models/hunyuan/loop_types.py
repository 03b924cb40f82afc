"""The running loop's data: its rows, what it hands back, how it is configured, what it counts.

Why a module of its own: the loop (ocrq/models/hunyuan/running.py), its runner and the runner's
collaborators (the prefill passes, the harvest, the warm-up) all speak of these; kept here,
each of them imports the words and none imports the loop. No torch at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.inputs import EncodedImage
from ocrq.models.hunyuan.versions import RepetitionGuard
from ocrq.models.loop.lane_pass import LanePolicy

if TYPE_CHECKING:
    import torch

SCHEDULES = ("alternate", "chunked")
# The fused decode step's rows at most (ocrq/models/hunyuan/fused_step.py: one 16-row tile).
FUSED_STEP_MAX_ROWS = 16
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # graphed slot counts
# The smallest bucket a loop uses unless its config says otherwise (`LoopConfig.min_bucket`):
# 8, as measured in every lanes run; 1, 2 and 4 are a lab lever (OCRQ_LOOP_MIN_BUCKET) until a
# loop run shows them paying (bench/results/lanes_sim/README.md: the lead).
MIN_BUCKET = 8
SMALL_BUCKETS = (1, 2, 4, 8)  # the values `min_bucket` may take


def bucket_of(top: int, slots: int, smallest: int = MIN_BUCKET) -> int:
    """Slots a decode step over the first `top` slots runs over: the smallest bucket of at
    least `smallest` slots covering them, at most the loop's `slots`."""
    for b in BUCKETS:
        if b >= top and b >= smallest:
            return min(b, slots)
    return slots


@dataclass
class LoopRow:
    """One image in the running loop. `max_new_tokens` is the row's own cap (at most the loop's):
    the row ends there as it would at an eos (`truncated="max_tokens"`)."""

    key: str
    encoded: EncodedImage
    max_new_tokens: int
    min_new_tokens: int = 0  # eos banned before this many tokens (benches force lengths)
    interactive: bool = False  # the job's lane (ocrq/models/loop/lane_pass.py)
    # Set by the loop.
    # The loop's hooks' token index at which the row takes eos (ocrq/models/hunyuan/hooks.py);
    # None: the model's own choice (always, without hooks).
    eos_at: int | None = None
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
    # The interactive lane (ocrq/models/loop/lane_pass.py): reserved slots, bulk limits while busy.
    lanes: LanePolicy = field(default_factory=LanePolicy)
    # Prefill passes on a side stream of low priority, committed once done, while decode steps
    # go on on the loop's own stream of high priority (ocrq/models/hunyuan/passes.py). On a CPU
    # the pass is launched at once and committed at a later iteration (tests).
    prefill_stream: bool = False
    # Decode steps over buckets of at most this many slots by the fused few-row step (0: none;
    # at most 16; ocrq/models/hunyuan/step_choice.py). A lab lever: OCRQ_LOOP_FUSED_STEP_ROWS.
    fused_step_rows: int = 0
    # The smallest slot count a decode step runs over (1, 2, 4 or 8; a lab lever,
    # OCRQ_LOOP_MIN_BUCKET). Below 8, a step over one or two live rows (the interactive lane's
    # extra steps, a quiet loop) reads no idle slots' rows, at one more CUDA graph per bucket.
    min_bucket: int = MIN_BUCKET

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if not 0 <= self.fused_step_rows <= FUSED_STEP_MAX_ROWS:
            raise ValueError(f"fused_step_rows must be 0 (off) to {FUSED_STEP_MAX_ROWS} (the "
                             f"fused step's rows at most), not {self.fused_step_rows}")
        if self.min_bucket not in SMALL_BUCKETS:
            raise ValueError(f"min_bucket must be one of {SMALL_BUCKETS}, not {self.min_bucket}")
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
    # The lanes (ocrq/models/loop/lane_pass.py). "Busy": an interactive row live or waiting. An
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

    def metrics(self) -> dict[str, float]:
        """The account by the names of the worker's loop counters (ocrq/core/metrics.py
        `LOOP_COUNTS`)."""
        return {
            "prefill_seconds": self.prefill_s,
            "decode_seconds": self.decode_s,
            "prefills": self.prefills,
            "prefilled_rows": self.prefilled_rows,
            "steps": self.steps,
            "row_steps": self.row_steps,
            "slot_steps": self.slot_steps,
            "prefill_host_seconds": self.prefill_host_s,
            "decode_host_seconds": self.decode_host_s,
            "harvest_host_seconds": self.harvest_host_s,
            "wait_seconds": self.wait_s,
            "prefill_cpu_seconds": self.prefill_cpu_s,
            "cpu_seconds": self.cpu_s,
            "prefill_tokens": self.prefill_tokens,
            "prefilled_interactive": self.prefilled_interactive,
            "lane_steps": self.lane_steps,
            "lane_row_steps": self.lane_row_steps,
            "interactive_row_steps": self.interactive_row_steps,
            "kv_token_steps": self.kv_token_steps,
            "lane_decode_seconds": self.lane_decode_s,
            "lane_prefill_seconds": self.lane_prefill_s,
            "lane_prefills": self.lane_prefills,
            "lane_prefill_tokens": self.lane_prefill_tokens,
            "bulk_held_passes": self.bulk_held_passes,
            "extra_steps": self.extra_steps,
            "extra_decode_seconds": self.extra_decode_s,
            "pass_steps": self.pass_steps,
            "late_passes": self.late_passes,
            "pending_iterations": self.pending_iterations,
            "overlap_steps": self.overlap_steps,
        }
