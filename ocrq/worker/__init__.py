"""The Celery side: app and task, batcher, planner, image intake, runtime wiring."""
