"""Batching: the batchers (static, streaming), the planner and governor (pure), the executor of
a planned batch, downscaling, recycling, and the engine-side wiring. Knows nothing of Celery."""
