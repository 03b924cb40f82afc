"""The Celery side: app and task, acking, broker, heartbeat, health, the supervisor, and the
runtime wiring that starts the engine (here or in an engine process) for one worker process."""
