"""Prometheus metrics of a worker process, and the stages a job's latency is split into.

Why multiprocess-aware: under `ocrq worker` (supervised) each worker process is recycled after
`OCRQ_MAX_IMAGES`, and counters kept in its memory would die with it. The supervisor gives each
child a `PROMETHEUS_MULTIPROC_DIR` (ocrq/worker/supervisor.py); prometheus-client then keeps every
value in a file per process there, and the supervisor, which outlives recycles, serves their sum
(ocrq/worker/monitor.py). Counters and histograms of exited processes stay counted; gauges are
`live*` modes, so an exited process's gauges vanish once the supervisor marks it dead. Under
`--no-supervise` the process serves its own values: its orchestrator restarts the whole
container, and Prometheus' `rate()` / `increase()` handle the counter reset.

Names are listed in docs/operations.md, "Metrics and health"; keep the two together.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

# The stages of one job, in order; `ocrq_stage_seconds{stage=...}` observes each once per job,
# so the means add up to the job's end-to-end time (gpu = the engine time of its batch).
STAGES = ("queue_wait", "fetch_decode", "preprocess", "batch_wait", "gpu", "store", "ack")
# 1 ms .. 1 h: a rapid image's preprocess is milliseconds, a queue wait under load is minutes.
STAGE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip

JOBS = Counter("ocrq_jobs_total", "Jobs finished by this worker", ["status", "engine"])
STAGE_SECONDS = Histogram(
    "ocrq_stage_seconds", "Seconds one job spent in each stage", ["stage"], buckets=STAGE_BUCKETS
)
# Per lane (a job's priority, interactive or bulk): how long its jobs waited, from the
# producer's enqueue to the end of their batch less the engine time, and that engine time.
LANE_WAIT_SECONDS = Histogram(
    "ocrq_lane_wait_seconds",
    "Seconds a job waited from enqueue to its engine time, by lane",
    ["lane"],
    buckets=STAGE_BUCKETS,
)
LANE_SERVICE_SECONDS = Histogram(
    "ocrq_lane_service_seconds",
    "Engine seconds of a job's batch or running-loop row, by lane",
    ["lane"],
    buckets=STAGE_BUCKETS,
)
BATCHES = Counter("ocrq_batches_total", "Engine batches run")
BATCH_SIZE = Histogram(
    "ocrq_batch_images", "Images per batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
)
BATCH_SECONDS = Histogram("ocrq_batch_seconds", "Engine time per batch", buckets=STAGE_BUCKETS)
RECYCLES = Counter("ocrq_recycles_total", "Worker recycles requested", ["reason"])
OOM_EVENTS = Counter("ocrq_oom_events_total", "Device out-of-memory events recovered from")

# The running loop's own work (engines with one; `StreamingEngine.loop_counts`): GPU seconds in
# prefill passes and decode steps (CUDA events, so the GPU's busy share is their rate), and
# steps, live rows x steps and slots x steps (their ratio: how full the graphed steps ran).
LOOP_COUNTS = {
    "prefill_seconds": Counter("ocrq_loop_prefill_seconds", "GPU seconds in prefill passes"),
    "decode_seconds": Counter("ocrq_loop_decode_seconds", "GPU seconds in decode steps"),
    "prefills": Counter("ocrq_loop_prefills", "Prefill passes run by the running loop"),
    "prefilled_rows": Counter("ocrq_loop_prefilled_rows", "Rows prefilled into the running loop"),
    "steps": Counter("ocrq_loop_steps", "Decode steps run by the running loop"),
    "row_steps": Counter("ocrq_loop_row_steps", "Live rows summed over decode steps"),
    "slot_steps": Counter("ocrq_loop_slot_steps", "Slots stepped summed over decode steps"),
    # The loop thread's host seconds: little waiting and the rest near the wall time means the
    # host, not the GPU, sets the pace.
    "prefill_host_seconds": Counter(
        "ocrq_loop_prefill_host_seconds", "Loop thread seconds admitting and launching prefills"
    ),
    "decode_host_seconds": Counter(
        "ocrq_loop_decode_host_seconds", "Loop thread seconds launching decode steps"
    ),
    "harvest_host_seconds": Counter(
        "ocrq_loop_harvest_host_seconds", "Loop thread seconds reading finished rows"
    ),
    "wait_seconds": Counter(
        "ocrq_loop_wait_seconds", "Loop thread seconds waiting for the GPU to catch up"
    ),
    # Its CPU seconds: far below its host seconds, the thread waited for the GIL.
    "prefill_cpu_seconds": Counter(
        "ocrq_loop_prefill_cpu_seconds", "Loop thread CPU seconds in prefill passes"
    ),
    "cpu_seconds": Counter("ocrq_loop_cpu_seconds", "Loop thread CPU seconds in all"),
    # The interactive lane (ocrq/models/loop/lane_pass.py): what an interactive row's token costs is
    # (lane_decode_seconds + lane_prefill_seconds) / lane_steps; kv_token_steps / steps is the
    # KV a step reads.
    "prefill_tokens": Counter("ocrq_loop_prefill_tokens", "Prompt tokens prefilled"),
    "prefilled_interactive": Counter(
        "ocrq_loop_prefilled_interactive_rows", "Interactive rows prefilled"
    ),
    "lane_steps": Counter("ocrq_loop_lane_steps", "Decode steps with an interactive row live"),
    "lane_row_steps": Counter(
        "ocrq_loop_lane_row_steps", "Live rows summed over decode steps with an interactive row"
    ),
    "interactive_row_steps": Counter(
        "ocrq_loop_interactive_row_steps", "Live interactive rows summed over decode steps"
    ),
    "kv_token_steps": Counter("ocrq_loop_kv_token_steps", "Live KV tokens summed over steps"),
    # OCRQ_INTERACTIVE_EXTRA_STEPS: steps over the interactive rows' slots only (also counted
    # in steps, lane_steps and lane_decode_seconds).
    "extra_steps": Counter(
        "ocrq_loop_extra_steps", "Interactive-only decode steps (OCRQ_INTERACTIVE_EXTRA_STEPS)"
    ),
    "extra_decode_seconds": Counter(
        "ocrq_loop_extra_decode_seconds", "GPU seconds in interactive-only decode steps"
    ),
    "pass_steps": Counter(
        "ocrq_loop_pass_steps",
        "Interactive-only steps run beside a pending prefill pass (OCRQ_INTERACTIVE_PASS_STEPS)",
    ),
    "lane_decode_seconds": Counter(
        "ocrq_loop_lane_decode_seconds", "GPU seconds in decode steps with an interactive row"
    ),
    "lane_prefill_seconds": Counter(
        "ocrq_loop_lane_prefill_seconds",
        "GPU seconds in prefill passes while an interactive row waited or decoded",
    ),
    "lane_prefills": Counter(
        "ocrq_loop_lane_prefills", "Prefill passes while an interactive row waited or decoded"
    ),
    "lane_prefill_tokens": Counter(
        "ocrq_loop_lane_prefill_tokens",
        "Prompt tokens prefilled while an interactive row waited or decoded",
    ),
    "bulk_held_passes": Counter(
        "ocrq_loop_bulk_held_passes", "Prefill passes that held bulk rows back for the lane"
    ),
    # Prefill passes on a side stream (OCRQ_PREFILL_STREAM): prefill and decode seconds then
    # overlap, and their sum can pass the wall time.
    "late_passes": Counter(
        "ocrq_loop_late_passes", "Prefill passes committed at a later loop iteration than launched"
    ),
    "pending_iterations": Counter(
        "ocrq_loop_pending_iterations", "Loop iterations that found a prefill pass not done yet"
    ),
    "overlap_steps": Counter(
        "ocrq_loop_overlap_steps", "Decode steps run while a prefill pass was pending"
    ),
}


def count_loop(now: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    """Add what the loop did since `last` to the counters; returns `now` (the next `last`)."""
    for name, value in now.items():
        counter = LOOP_COUNTS.get(name)
        if counter is not None and value > last.get(name, 0.0):
            counter.inc(value - last.get(name, 0.0))
    return now


# Gauges: the value of the live worker process (livemax / livesum over its one process).
# The planner's `deferred`: images that waited on when the last batch was planned. Above zero
# with batches below OCRQ_MAX_BATCH, the memory budget (not the count) is what closes batches.
DEFERRED = Gauge(
    "ocrq_batch_deferred_images",
    "Images left waiting by the last batch planned",
    multiprocess_mode="livemax",
)
BUDGET_BYTES = Gauge(
    "ocrq_batch_budget_bytes",
    "Memory budget batches are planned to now (lowered after an OOM)",
    multiprocess_mode="livemax",
)
CONFIGURED_BUDGET_BYTES = Gauge(
    "ocrq_batch_configured_budget_bytes",
    "Memory budget the worker was configured with (above the fixed part)",
    multiprocess_mode="livemax",
)
PLANNED_PEAK_BYTES = Gauge(
    "ocrq_batch_planned_peak_bytes",
    "Peak memory the cost model predicted for the last batch (fixed part included)",
    multiprocess_mode="livemax",
)
MEASURED_PEAK_BYTES = Gauge(
    "ocrq_batch_measured_peak_bytes",
    "Peak memory measured during the last batch (device tensors, or host RSS for CPU engines)",
    multiprocess_mode="livemax",
)
IN_FLIGHT = Gauge(
    "ocrq_images_in_flight",
    "Decoded images held: prefetched, waiting for a batch, or in the running batch",
    multiprocess_mode="livesum",
)
GPU_BYTES = Gauge(
    "ocrq_gpu_memory_bytes",
    "torch.cuda memory after the last batch (kind: allocated | reserved)",
    ["kind"],
    multiprocess_mode="livemax",
)
# Health (ocrq/worker/health.py reads these back, in this process or through the supervisor).
READY = Gauge(
    "ocrq_worker_ready", "1 once the engine is loaded and consuming", multiprocess_mode="livemax"
)
STARTED_AT = Gauge(
    "ocrq_worker_started_timestamp_seconds",
    "When the worker process started",
    multiprocess_mode="livemax",
)
HEARTBEAT_AT = Gauge(
    "ocrq_worker_heartbeat_timestamp_seconds",
    "Last tick of the worker process's heartbeat thread (whether or not the database answered)",
    multiprocess_mode="livemax",
)
DATABASE_WAIT_SINCE = Gauge(
    "ocrq_worker_database_wait_since_timestamp_seconds",
    "When the starting worker began waiting for its database (reachable, at the Alembic head); "
    "0 once it answered",
    multiprocess_mode="livemax",
)
BROKER_WAIT_SINCE = Gauge(
    "ocrq_worker_broker_wait_since_timestamp_seconds",
    "When the worker's first failed attempt to reach its broker was; 0 once connected",
    multiprocess_mode="livemax",
)
BATCH_SINCE = Gauge(
    "ocrq_batch_running_since_timestamp_seconds",
    "When the batch running now started (the running loop, an engine process: the last time a "
    "row finished while others were in it); 0 while the engine is idle",
    multiprocess_mode="livemax",
)


def engine_progress(busy: bool) -> None:
    """For engines without whole batches: rows reached an idle engine, or some row finished;
    `busy`: rows are still in it. Liveness fails when this stays older than a job may take
    (ocrq/worker/health.py), as for a batch that hangs."""
    BATCH_SINCE.set(time.time() if busy else 0)


def observe_stage(stage: str, seconds: float) -> None:
    STAGE_SECONDS.labels(stage).observe(max(0.0, seconds))


def observe_lane(lane: str, waited_s: float, service_s: float) -> None:
    LANE_WAIT_SECONDS.labels(lane).observe(max(0.0, waited_s))
    LANE_SERVICE_SECONDS.labels(lane).observe(max(0.0, service_s))


@contextmanager
def stage_timer(stage: str) -> Iterator[None]:
    """Observe the time the block took as `stage` (also when it raises)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        observe_stage(stage, time.perf_counter() - t)


def gpu_memory() -> tuple[int, int] | None:
    """torch.cuda's allocated and reserved bytes, when this process has initialised CUDA (never
    imports torch or initialises CUDA itself: a CPU worker stays without them)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def set_gpu_memory(reading: tuple[int, int] | None) -> None:
    """`GPU_BYTES` from a `gpu_memory()` reading, this process's or its engine process's."""
    if reading is not None:
        GPU_BYTES.labels("allocated").set(reading[0])
        GPU_BYTES.labels("reserved").set(reading[1])


def sample_gpu_memory() -> None:
    set_gpu_memory(gpu_memory())
