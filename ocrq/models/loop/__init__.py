"""The running loop's scheduler, pure (no torch, no device): it plans, a runner executes.

`LoopScheduler` owns the loop's only waiting queue, its lane rule (ocrq/models/loop/lane_pass.py)
and its KV book (ocrq/models/slots.py `KvPool`); each tick it returns a frozen `StepPlan` and
takes the runner's `StepOutput` back (`schedule -> StepOutput -> update`, as vLLM v1's scheduler
does). The Hunyuan running loop (ocrq/models/hunyuan/running.py) drives it with its runner;
tests/test_loop_scheduler.py drives it alone. Here, under models/, because the engine that
drives it may not import the scheduling layer above it (pyproject.toml's contracts).
"""

from ocrq.models.loop.plan import Admit, Request, StepOutput, StepPlan
from ocrq.models.loop.scheduler import LoopScheduler, SchedulerConfig

__all__ = ["Admit", "LoopScheduler", "Request", "SchedulerConfig", "StepOutput", "StepPlan"]
