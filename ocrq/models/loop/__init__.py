"""The running loop's scheduler, pure (no torch, no device): it plans, a runner executes.

`LoopScheduler` owns the loop's waiting queue, its lane rule (ocrq/models/loop/lane_pass.py) and its
KV book (ocrq/models/slots.py `KvPool`); each tick it returns a frozen `StepPlan` and takes the
runner's `StepOutput` back (`schedule -> StepOutput -> update`, as vLLM v1's scheduler does).
Not wired yet: the Hunyuan running loop (ocrq/models/hunyuan/running.py) still plans its own
passes; tests/test_loop_scheduler.py drives this one alone and against that loop's policy.
"""

from ocrq.models.loop.plan import Admit, Request, StepOutput, StepPlan
from ocrq.models.loop.scheduler import LoopScheduler, SchedulerConfig

__all__ = ["Admit", "LoopScheduler", "Request", "SchedulerConfig", "StepOutput", "StepPlan"]
