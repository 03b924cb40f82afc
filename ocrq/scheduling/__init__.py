"""Batching: the batchers (static, streaming), the planner and governor (pure), the executor of
a planned batch, downscaling, recycling, and the engine-side wiring; `loop/`, the running loop's
scheduler (pure; not wired into the loop yet). Knows nothing of Celery."""
