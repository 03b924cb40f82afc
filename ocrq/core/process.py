"""The process: its environment defaults and its process-wide state, each in one place.

Why one module: a worker process carries a little state that outlives any one call (its worker
name, its runtime, why it is exiting, its PDF render pool, ...). Spread over the modules that
use it, a reader could not tell what a process holds, nor a test what to look at; here it is one
object, `STATE`, whose fields say who sets and who reads them. The modules that use a field keep
their functions (`runtime.configure`, `exit_state.request_recycle`, ...): only the storage moved.

What stays elsewhere, and why: Prometheus metric objects (ocrq/core/metrics.py: the registry is
the prometheus_client library's own global); the vLLM op library kept alive in
ocrq/models/vllm/compat.py (vLLM holds a reference to it by registration, not through us); the
URL fetcher's DNS thread pool (ocrq/intake/fetch.py: stateless workers, made at import);
memoizing caches (`functools.cache`: the database engines, kernel and attention probes), which
hold answers, not state; the ASGI `app` objects uvicorn imports; module-level constants.

The environment defaults are set by `setup_process`, which every entry point that may run an
engine calls first (`ocrq worker`'s worker process, the engine process, `ocrq run`, `ocrq
tune`), before anything allocates on a GPU.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ocrq.core.startup import Timeline

if TYPE_CHECKING:
    from ocrq.core.settings import Settings

# Set unless the user set them. Batches of varying shapes fragment PyTorch's caching allocator:
# on an H200 a worker held 32.8 GiB reserved but unallocated beside 104.7 GiB of tensors and hit
# an out-of-memory error at a planned 105.9 GiB
# (bench/results/service_gpu/service_gpu_h200_run1.md). Expandable segments let freed blocks
# grow into one another instead of stranding memory between batches of different shapes. Read at
# the first CUDA allocation, so it must be set before any.
ENV_DEFAULTS: dict[str, str] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def apply_env_defaults() -> None:
    """ENV_DEFAULTS, where the environment has no value of its own. Also called by
    HunyuanOCR's checkpoint loader, for code that loads an engine without an entry point (tests,
    benches, a library user): the first CUDA allocation may be there."""
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def setup_process(settings: Settings) -> None:
    """What a process that may run an engine sets up once, first: the environment defaults and
    the GIL switch interval (OCRQ_SWITCH_INTERVAL_MS: a shorter one lets the thread that feeds
    the GPU take the GIL back sooner from task and preprocessing threads)."""
    apply_env_defaults()
    if settings.switch_interval_ms is not None:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)


@dataclass
class ProcessState:
    """Everything process-wide a worker process holds; one instance, `STATE`."""

    # The Settings the worker process runs with, its Celery node name, and the worker name it
    # claims jobs, beats and holds messages under: set by `ocrq.worker.runtime.configure` before
    # Celery consumes anything; read by `get_runtime` and by the broker's QoS
    # (ocrq/worker/broker.py), which records the holder of each message it takes.
    settings: Settings | None = None
    node: str | None = None
    worker_name: str | None = None
    # The worker's Runtime (ocrq/worker/runtime.py), built once on first use, under its lock.
    runtime: Any = None
    # The worker's engine, started by its entry point before the rest of its set-up
    # (ocrq/worker/engine_start.py), until the runtime's engine component takes it.
    engine_start: Any = None
    runtime_lock: threading.Lock = field(default_factory=threading.Lock)
    # Why this process is exiting (a recycle, a failed start): the first request wins
    # (ocrq/worker/exit_state.py).
    exit_code: int | None = None
    exit_lock: threading.Lock = field(default_factory=threading.Lock)
    # The stop signal Celery's warm shutdown began with ("SIGTERM"), whoever sent it: set at
    # `worker_shutting_down` (ocrq/worker/celery_app.py); a recycle due after it is no recycle.
    stopping: str | None = None
    # Task id -> when its task returned, until its message is acked (ocrq/worker/acking.py).
    returned: dict[str, float] = field(default_factory=dict)
    returned_lock: threading.Lock = field(default_factory=threading.Lock)
    # The PDF render pool, made on first use (ocrq/intake/render_pool.py).
    render_pool: Any = None
    render_pool_lock: threading.Lock = field(default_factory=threading.Lock)
    # This process's start-up timeline (ocrq/core/startup.py): each phase of its start records
    # itself here where it runs (the entry points, the engine's loading, the running loop's
    # warm-up); the worker logs it once ready (ocrq/worker/celery_app.py) and its first stored
    # result (ocrq/worker/completing.py). An engine process sends its own to its worker.
    timeline: Timeline = field(default_factory=Timeline)


STATE = ProcessState()
