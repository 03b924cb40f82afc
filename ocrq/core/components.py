"""Start and stop the parts of a process in one declared order (Celery's bootsteps, simpler).

Why a list: the worker's parts depend on each other (the batcher runs on the loaded engine; the
heartbeat may stop only once no job of ours is running, so after the batcher), and when that
order was written out three times (building the runtime, closing it, the engine process) a
part added to one place was missed in another, and a start that failed half-way left what had
started running. Here each part is a `Component` with a `start` and a `stop`; `Components`
starts them in the order given, stops them in the reverse order, and when a start fails stops
those already started before the error goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Component:
    """One part: `start` brings it up (reading what earlier parts started), `stop` takes it
    down, after every part started after it has stopped. A `start` that raises must leave
    nothing of its own running: its `stop` is not called (it never started)."""

    name: str
    start: Callable[[], None]
    stop: Callable[[], None]


class Components:
    """Parts started in order and stopped in reverse; `started` names those running now."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # for the log: "worker", "engine process"
        self._started: list[Component] = []

    @property
    def started(self) -> list[str]:
        return [c.name for c in self._started]

    def start(self, components: Iterable[Component]) -> None:
        """Start each in order. A start that raises stops the ones started (in reverse) and
        re-raises: nothing half-started is left running."""
        for component in components:
            log.info("%s: starting %s", self.owner, component.name)
            try:
                component.start()
            except BaseException as exc:
                # INFO: the exception goes on up, and whoever catches it says why in its own
                # words (the worker's CRITICAL line, `ocrq run`'s one-line reason); an ERROR
                # here printed a second, vaguer line before that reason.
                log.info(
                    "%s: %s failed to start (%s); stopping %s",
                    self.owner, component.name, type(exc).__name__,
                    ", ".join(reversed(self.started)) or "nothing",
                )
                self.stop()
                raise
            self._started.append(component)

    def stop(self) -> None:
        """Stop the started parts, last first; each step logged, so a shutdown that hangs says
        where. A stop that raises is logged and the others still stop; the first such error is
        raised at the end."""
        first: BaseException | None = None
        while self._started:
            component = self._started.pop()
            log.info("shutdown: %s: stopping %s", self.owner, component.name)
            try:
                component.stop()
            except BaseException as exc:
                log.exception("shutdown: %s: stopping %s failed", self.owner, component.name)
                first = first or exc
        if first is not None:
            raise first
