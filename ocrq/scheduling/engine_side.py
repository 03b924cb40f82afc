"""The engine side of a worker: load the engine, pick its cost model and batch budget, start
the batcher its scheduler calls for. Runs in the worker process, or in its engine process
(ocrq/engine_process/host.py); the worker's wiring is ocrq/worker/runtime.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ocrq.core.lanes import LaneRule
from ocrq.core.process import STATE
from ocrq.core.settings import BatchingSettings, Settings
from ocrq.models.base import Engine, streaming
from ocrq.models.costs import CostModel, GiB
from ocrq.models.memory import memory_of
from ocrq.models.registry import create_engine
from ocrq.scheduling.batcher import StaticBatcher
from ocrq.scheduling.streaming import StreamingBatcher
from ocrq.scheduling.vocabulary import BatchConfig, Batcher, BatchRecord
from ocrq.tuning.profiles import ProfileChoice, choose_cost_model

log = logging.getLogger(__name__)


def batch_config(
    settings: BatchingSettings,
    engine: Engine,
    model: CostModel | None = None,
    tuned_max_batch: int | None = None,
) -> BatchConfig:
    """The budget a batch may use above the fixed part of `model` (a tuned profile's, when the
    worker found one; else the engine's default), and the batch cap: OCRQ_MAX_BATCH, else the
    knee `ocrq tune --images` recommended in that profile, else the engine's preference."""
    fixed = (model or engine.cost_model()).fixed_bytes
    if settings.memory_budget_gib is not None:
        # Plan to a share of the budget: the allocator's cache and workspaces live in the rest
        # (on the H200 a batch using 17.3 GiB of tensors had 19.4 GiB reserved).
        usable = settings.memory_budget_gib * settings.memory_utilization
        budget = int(usable * GiB) - fixed
        if budget <= 0:
            raise ValueError(
                f"OCRQ_MEMORY_BUDGET_GIB={settings.memory_budget_gib} x OCRQ_MEMORY_UTILIZATION="
                f"{settings.memory_utilization} does not cover the engine's fixed part "
                f"({fixed / GiB:.2f} GiB)"
            )
    else:
        budget = memory_of(engine).default_budget_bytes()
    return BatchConfig(
        max_items=settings.max_batch or tuned_max_batch or engine.preferred_max_batch(),
        wait_s=settings.batch_wait_ms / 1000,
        budget_bytes=budget,
        lanes=LaneRule(bulk_max_wait_s=settings.bulk_max_wait_s),
    )


@dataclass
class EngineSide:
    """The loaded engine, its cost model and its budget: what runs in the worker process, or in
    its engine process (ocrq/engine_process/host.py), with the batcher `start` gives it."""

    engine: Engine
    config: BatchConfig
    choice: ProfileChoice

    def start(self, on_batch: Callable[[BatchRecord], None] | None = None) -> Batcher:
        """The batcher the engine's scheduler calls for, started."""
        engine, config, model = self.engine, self.config, self.choice.model
        looping = streaming(engine)
        if looping is not None:
            # Continuous batching: the engine's running loop (OCRQ_SCHEDULER=continuous).
            timeline = STATE.timeline
            with timeline.phase("loop open"):
                batcher = StreamingBatcher(looping, config, on_batch, model)
            # Before the batcher's thread drives the loop: what the first rows would otherwise
            # wait for (CUDA graphs, kernels compiled on first use) is done now, while the
            # worker still starts.
            with timeline.phase("warm-up", unless_inner=True):
                looping.warm_up()
            return batcher.start()
        return StaticBatcher(engine, config, on_batch=on_batch, cost_model=model).start()


def load_engine(settings: Settings) -> EngineSide:
    """Load the engine and pick its cost model and batch budget."""
    timeline = STATE.timeline  # phases of a worker's start (ocrq/core/startup.py)
    engine = create_engine(settings.engine, settings)
    with timeline.phase("engine load", unless_inner=True):  # HunyuanOCR times its own steps
        engine.load()
    with timeline.phase("cost model"):
        choice = choose_cost_model(engine, settings.profile_dir)
    log.info(choice.describe())
    if settings.max_batch is None and choice.max_batch is not None:
        # The running loop sizes its slots from the engine's settings group
        # (`StreamingEngine.open`): the tuned knee is its slots too. An explicit OCRQ_MAX_BATCH
        # wins over the profile.
        settings.max_batch = choice.max_batch
        engine.take_tuned_max_batch(choice.max_batch)
        log.info("max batch %d: the knee of the tuned profile", choice.max_batch)
    return EngineSide(engine, batch_config(settings, engine, choice.model, choice.max_batch),
                      choice)
