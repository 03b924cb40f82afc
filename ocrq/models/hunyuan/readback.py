"""How the running loop's host learns what the GPU did without waiting for it.

Why: the loop thread queues decode steps far ahead of the GPU, and every host sync (a
`.tolist()`, a `torch.tensor(list, device=cuda)`, a boolean-mask index) empties that queue; the
GPU then idles for however long the thread takes to queue the next step. Inside a Celery worker
that thread shares the GIL with hundreds of task threads and the preprocessing, so each sync can
cost milliseconds: the service kept an H200 57% busy where the same loop alone kept it 92%
(bench/results/service_gpu/service_gpu_reading.md). So:

* `to_device` sends small host lists through pinned memory, asynchronously;
* `Readback` copies the slots' state (finished flags, token counts, guard stops, output tokens)
  into pinned host buffers behind the queued steps and records an event; the host reads the copy
  at a later check, once the event says it landed, and harvests the rows finished in it;
* `GpuClock` times prefill passes and decode steps with CUDA events, summed when they are done,
  so the loop's stats stay GPU time without a sync.

On a CPU every copy is immediate and every read sees the current step: the loop behaves as a
synchronous one. `lag` makes a CPU copy "land" only after that many looks, so the CPU tests run
the GPU's policy too (rows harvested from a copy older than the slots' state, slots refilled
meanwhile).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def to_device(values: Sequence[int] | torch.Tensor, dtype: Any, device: Any) -> torch.Tensor:
    """A small host list or CPU tensor on the device, without a sync on a GPU (through pinned
    memory: from pageable memory even a `non_blocking` copy waits)."""
    import torch

    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Snapshot:
    """The slots' state as of one point in the queue, and which row held each slot then."""

    rows: dict[int, Any]  # slot -> the row object in it when the copy was queued
    finished: list[bool]
    counts: list[int]
    stopped: list[int]
    out: Any  # host tensor (slots, max_new_tokens) of token ids


class Readback:
    """One asynchronous copy of the slots' state in flight at a time (pinned buffers reused)."""

    def __init__(self, slots: int, max_new_tokens: int, device: Any, lag: int = 0) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.lag = lag  # CPU only: looks before a copy counts as landed (tests)
        self._looks = 0
        # Host seconds spent waiting for a copy to land: the host was ahead of the GPU.
        self.waited_s = 0.0
        pin = self.cuda
        long = torch.long
        self._finished = torch.zeros(slots, dtype=torch.bool, pin_memory=pin)
        self._counts = torch.zeros(slots, dtype=long, pin_memory=pin)
        self._stopped = torch.zeros(slots, dtype=long, pin_memory=pin)
        self._out = torch.zeros(slots, max_new_tokens, dtype=long, pin_memory=pin)
        self._pending: tuple[dict[int, Any], int, Any] | None = None  # rows, k, event

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def asynchronous(self) -> bool:
        """Whether a copy can be read later than it was queued (a GPU, or a lagged CPU)."""
        return self.cuda or self.lag > 0

    def queue(
        self,
        rows: dict[int, Any],
        k: int,
        finished: torch.Tensor,
        counts: torch.Tensor,
        stopped: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Copy slots [0, k) behind the work queued so far; `rows` is who holds each slot now."""
        import torch

        if self._pending is not None:
            raise RuntimeError("a readback is already in flight")
        nb = self.cuda
        self._finished[:k].copy_(finished[:k], non_blocking=nb)
        self._counts[:k].copy_(counts[:k], non_blocking=nb)
        self._stopped[:k].copy_(stopped[:k], non_blocking=nb)
        self._out[:k].copy_(out[:k], non_blocking=nb)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (dict(rows), k, event)
        self._looks = 0

    def take(self, wait: bool = False) -> Snapshot | None:
        """The copy in flight once it has landed (at once with `wait`); None while it has not
        or when none was queued."""
        if self._pending is None:
            return None
        rows, k, event = self._pending
        if event is not None:
            if wait:
                t = time.perf_counter()
                event.synchronize()
                self.waited_s += time.perf_counter() - t
            elif not event.query():
                return None
        elif not wait and self._looks < self.lag:
            self._looks += 1
            return None
        self._pending = None
        return Snapshot(
            rows,
            self._finished[:k].tolist(),
            self._counts[:k].tolist(),
            self._stopped[:k].tolist(),
            self._out[:k],
        )

    def drop(self) -> None:
        """Forget the copy in flight (the loop was cleared)."""
        self._pending = None


class GpuClock:
    """Seconds of GPU time per named span, from CUDA events read once they are done (host
    seconds on a CPU, where the work runs inside the span). The events go on the current
    stream: a prefill pass on the loop's side stream (`LoopConfig.prefill_stream`) is timed
    there, and its span overlaps the decode steps' spans."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.totals: dict[str, float] = {}
        self._open: list[tuple[str, Any, Any]] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        import time

        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._open.append((name, start, end))

    def collect(self, wait: bool = False) -> dict[str, float]:
        """Add every finished span to the totals (all of them with `wait`); the totals."""
        still = []
        for name, start, end in self._open:
            if wait:
                end.synchronize()
            elif not end.query():
                still.append((name, start, end))
                continue
            self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._open = still
        return self.totals
