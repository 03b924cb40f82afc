"""The worker's engine, started first, so that the rest of the worker's start runs beside it.

Why: the engine is most of a worker's start (an engine process's interpreter and torch import,
the checkpoint read, the model moved to the GPU, the running loop's warm-up), and the worker's
own set-up (its imports, the database check, the Celery app) needs nothing of it. Run one after
the other, they added up (issue 29); here the entry point (ocrq/worker/main.py) starts the
engine before the database check, and the runtime's engine component
(ocrq/worker/runtime.py) takes what it started instead of starting another one.

Two forms, as OCRQ_ENGINE_PROCESS says (`engine_in_own_process`): an engine process, which
loads on its own while this process goes on (the default for HunyuanOCR on a GPU), or the engine
loaded in this process by a thread. A worker that will not start after all (its database is not
migrated) kills the engine process, or waits for the thread's load and closes the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ocrq.core.process import STATE
from ocrq.core.settings import Settings
from ocrq.engine_process.link import EngineLink, Spawned
from ocrq.worker.gpus import has_nvidia_gpu

if TYPE_CHECKING:
    from ocrq.scheduling.engine_side import EngineSide

log = logging.getLogger(__name__)

ENGINE_LANE = "engine"  # the timeline's lane of an engine loaded here (ocrq/core/startup.py)


def engine_in_own_process(settings: Settings) -> bool:
    """OCRQ_ENGINE_PROCESS, or where unset: HunyuanOCR on an NVIDIA GPU (found without CUDA)."""
    if settings.engine_process is not None:
        return settings.engine_process
    return settings.engine == "hunyuan" and settings.device != "cpu" and has_nvidia_gpu()


@dataclass
class Started:
    """What a started engine became: its engine process's link, or the engine loaded here."""

    link: EngineLink | None = None
    side: EngineSide | None = None


class EngineStart:
    """An engine starting beside the worker's other set-up; `result` waits for it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._spawned: Spawned | None = None
        self._side: EngineSide | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if engine_in_own_process(settings):
            self._spawned = EngineLink.spawn(settings)
        else:
            self._thread = threading.Thread(target=self._load, name="ocrq-engine-load",
                                            daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            with STATE.timeline.lane(ENGINE_LANE):
                # Imported here: the entry point starts an engine process before its own heavy
                # imports, and that path needs none of this.
                from ocrq.scheduling.engine_side import load_engine

                self._side = load_engine(self.settings)
        except BaseException as exc:  # handed to whoever waits (`result`)
            self._error = exc

    def result(self) -> Started:
        """The engine, once it has loaded (its load's error raised here, as a start-up failure
        of the engine component)."""
        started = time.time()
        try:
            if self._spawned is not None:
                return Started(link=self._spawned.wait())
            assert self._thread is not None
            self._thread.join()
            if self._error is not None:
                raise self._error
            assert self._side is not None
            return Started(side=self._side)
        finally:
            STATE.timeline.since("waiting for the engine", started)

    def abandon(self) -> None:
        """The worker will not start: end the engine process now, or wait for the load here and
        close what it loaded."""
        if self._spawned is not None:
            self._spawned.kill()
            return
        assert self._thread is not None
        self._thread.join()
        if self._side is not None:
            self._side.engine.close()


def start_engine(settings: Settings) -> EngineStart:
    """Start the worker's engine now; the runtime's engine component takes it (`take`)."""
    STATE.engine_start = start = EngineStart(settings)
    return start


def take(settings: Settings) -> EngineStart | None:
    """The engine `start_engine` started for these settings, once (None: start one)."""
    start: EngineStart | None = STATE.engine_start
    if start is None or start.settings is not settings:
        return None
    STATE.engine_start = None
    return start
