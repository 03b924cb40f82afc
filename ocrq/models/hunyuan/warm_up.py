"""The running loop's warm-up: before its first job, what its first jobs would otherwise wait for.

Why: on an H200 a worker was " ready." 21 s after its start, and its first result came 11.7 s
later with thousands of jobs waiting, the GPU busy 0.2% and 0.6% of its first two 5 s windows
(bench/results/service_gpu/service_gpu_h200_run18.md; issue 29). What runs on first use ran
then, one thing after another, while the GPU idled: FlashAttention-4 compiles on its first call
(~3 s), the Triton kernels are compiled or read from their cache, and each decode bucket's step
is captured as a CUDA graph the first time the loop reaches that many slots (8, 16, ... 256:
while the loop fills, each new bucket paid its capture). Here it is done once, before the
worker is ready, and beside the rest of its start (ocrq/worker/engine_start.py):

1. a made-up row (a small blank image, 2 new tokens) goes through the loop as a job would: its
   prefill pass (the vision tower, the packed prefill, their kernels' first calls), its first
   decode steps over the first bucket (eager, then captured), the harvest;
2. every other bucket's decode step runs once eagerly (its kernels' first calls) and is
   captured, as `LoopRunner._decode_step` does on a bucket's first use. A step over slots
   without a live row changes no slot's state (`LoopRunner.step`: every update is masked by
   `live`; only the scratch column is written), so this touches nothing a job will read;
3. the loop's account starts again empty, so its figures are the jobs' alone (the graphs
   captured and their seconds are kept: that is what the warm-up did).

Bounded by a deadline, checked between buckets: a bucket not captured by then is captured on its
first use, as before. Tokens are the same with or without it (tests/test_startup.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ocrq.models.hunyuan.loop_types import BUCKETS, Done, LoopConfig, LoopRow, LoopStats
from ocrq.models.hunyuan.readback import GpuClock

if TYPE_CHECKING:
    from ocrq.models.hunyuan.runner import LoopRunner


class WarmLoop(Protocol):
    """What the warm-up drives of a running loop (ocrq/models/hunyuan/running.py's
    `RunningLoop`): its public face and its runner (the decode step and its capture)."""

    config: LoopConfig

    @property
    def runner(self) -> LoopRunner: ...

    def add(self, rows: Sequence[LoopRow]) -> None: ...
    def drain(self) -> list[Done]: ...
    def idle(self) -> bool: ...
    def collect_stats(self, wait: bool = False) -> LoopStats: ...


def buckets(loop: WarmLoop) -> list[int]:
    """Every slot count a decode step of this loop can run over (`LoopBooks.bucket`)."""
    slots, smallest = loop.config.slots, loop.config.min_bucket
    return sorted({min(b, slots) for b in BUCKETS if b >= smallest})


def graphed(loop: WarmLoop) -> bool:
    """Whether the loop's decode steps are CUDA graphs (as `LoopRunner._decode_step` decides)."""
    decoder = loop.runner.decoder
    return bool(decoder.use_graph and decoder.is_cuda and not loop.config.keep_logits)


def warm_up(loop: WarmLoop, row: LoopRow | None, deadline: float) -> list[int]:
    """A step of the warm-up of an idle loop (the module's doc): with `row`, that row run to its
    end (1); without, every bucket not captured yet, until `deadline` (time.monotonic()) (2).
    Either way the books start again empty (3). The buckets graphed by then."""
    import torch

    if not loop.idle():
        raise RuntimeError("the running loop warms up before its first row, not after")
    if row is not None:
        loop.add([row])
        loop.drain()
    elif graphed(loop):
        with torch.inference_mode():
            for k in buckets(loop):
                if k in loop.runner.graphs:
                    continue
                if time.monotonic() >= deadline:
                    break
                loop.runner.step(k)  # its kernels' first calls, outside the capture
                loop.runner.capture(k)
    _forget_books(loop)
    return sorted(loop.runner.graphs)


def _forget_books(loop: WarmLoop) -> None:
    """The loop's account from here on is its jobs': all but the graphs it holds and their
    capture seconds start again from zero."""
    loop.collect_stats(wait=True)
    state = loop.runner.state
    state.stats = LoopStats(graphs=state.stats.graphs, capture_s=state.stats.capture_s)
    state.clock = GpuClock(state.clock.cuda)
    state.readback.waited_s = 0.0
