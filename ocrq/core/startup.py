"""A process's start-up timeline: where its seconds go from the process's start to ready.

Why: on an H200 a worker took 21.0 s from start to " ready." and 32.7 s to its first stored
result (bench/results/service_gpu/service_gpu_h200_run18.md), and nothing said where (issue 29).
Each phase of a start is timed where it runs and kept here; the worker logs them once it is
ready, one `startup:` line per phase, in seconds since its process started as the kernel counts
it (so the interpreter's start and the imports before any of ocrq's code ran are in it too),
then `startup: ready at`, and `startup: first result stored at` once a row is stored.
bench/startup.py and bench/service_gpu.py read those lines.

Lanes: the phases of one lane run one after another (the worker's main thread; its engine,
loaded beside it in a thread or in an engine process), so a lane's phases add up to no more than
the time to ready; lanes overlap. A phase is recorded in the lane of the thread that runs it
(`Timeline.lane`), so an engine's loading code names its phases without knowing where it runs.

Times are wall-clock (time.time()): an engine process's phases travel to its worker
(ocrq/engine_process/wire.py `Ready`) and are placed against the worker's own start.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ocrq.startup")

MAIN_LANE = "worker"
MAX_PHASES = 256  # a process that loads engines again and again (tests) keeps the first ones

# The lines `Timeline` logs, as `parse` reads them back (the benches, the tests).
_PHASE_LINE = re.compile(
    r"startup: \[(?P<lane>[^\]]+)\] (?P<name>.+?): (?P<seconds>[\d.]+) s "
    r"\((?P<start>-?[\d.]+) -> (?P<end>-?[\d.]+) s\)"
)
_READY_LINE = re.compile(r"startup: ready at (?P<at>-?[\d.]+) s")
_FIRST_LINE = re.compile(r"startup: first result stored at (?P<at>-?[\d.]+) s")


@dataclass(frozen=True)
class Phase:
    """One phase of a start: its lane, its name, and its wall-clock bounds."""

    lane: str
    name: str
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def process_started() -> float:
    """When this process started (wall clock), as the kernel recorded it: its start in clock
    ticks after boot (/proc/self/stat), against the clock of seconds since boot now, so the
    interpreter's own start counts. Where that cannot be read, now."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, `starttime`
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()
    return time.time() - max(0.0, age)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the big imports inside (torch, transformers, the
    worker's own), then what they made frozen (`gc.freeze`): modules, classes and functions
    live as long as the process, yet each collection of the oldest generation would walk them
    all again. Their hundreds of thousands of new objects set off collection after collection
    that found no garbage: importing torch and transformers took ~15% less CPU time without
    them on this project's CPU machine, and merely pausing the collector moved a 1.3 s
    collection into the checkpoint read. Process-wide; left on if another thread turned it on
    meanwhile. Only around imports: a model's loading makes garbage worth collecting."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


class Timeline:
    """The phases of this process's start, from `origin` (its start) on."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_started() if origin is None else origin
        self.phases: list[Phase] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.ready_at: float | None = None
        self._first_result = False
        self._imported = False
        self._open: dict[str, tuple[str, float]] = {}  # `begin` without its `end` yet

    def at(self, when: float) -> float:
        """Seconds since the process started."""
        return when - self.origin

    # -- recording ---------------------------------------------------------------------------

    @contextmanager
    def lane(self, name: str) -> Iterator[None]:
        """Phases this thread records inside are in lane `name`."""
        before = getattr(self._local, "lane", None)
        self._local.lane = name
        try:
            yield
        finally:
            self._local.lane = before

    def current_lane(self) -> str:
        return getattr(self._local, "lane", None) or MAIN_LANE

    @contextmanager
    def phase(self, name: str, *, unless_inner: bool = False) -> Iterator[None]:
        """Time what runs inside as phase `name` of this thread's lane (kept if it raises too:
        a failed start says where it spent its time). `unless_inner`: not where phases of this
        lane were recorded inside it (an engine that accounts for its own loading), so a lane's
        phases never overlap."""
        lane = self.current_lane()
        inner = self._count(lane)
        started = time.time()
        try:
            yield
        finally:
            if not (unless_inner and self._count(lane) > inner):
                self.add(Phase(lane, name, started, time.time()))

    def _count(self, lane: str) -> int:
        with self._lock:
            return sum(p.lane == lane for p in self.phases)

    def imported(self) -> None:
        """Phase "imports", from the process's start to now, once: the interpreter's start and
        the imports before an entry point's first line (the first to call this is the entry)."""
        with self._lock:
            if self._imported:
                return
            self._imported = True
        self.add(Phase(self.current_lane(), "imports", self.origin, time.time()))

    def begin(self, name: str) -> None:
        """Phase `name` of this thread's lane starts now; `end` (from any thread) closes it."""
        with self._lock:
            self._open[name] = (self.current_lane(), time.time())

    def end(self, name: str) -> None:
        """Close phase `name` that `begin` opened (nothing if none is open)."""
        with self._lock:
            opened = self._open.pop(name, None)
        if opened is not None:
            self.add(Phase(opened[0], name, opened[1], time.time()))

    def since(self, name: str, started: float) -> None:
        """Phase `name` of this thread's lane, from `started` (wall clock) to now."""
        self.add(Phase(self.current_lane(), name, started, time.time()))

    def add(self, phase: Phase) -> None:
        with self._lock:
            if len(self.phases) < MAX_PHASES:
                self.phases.append(phase)

    def extend(self, phases: Iterable[Phase], lane: str | None = None) -> None:
        """Another process's phases (an engine process's), in `lane` where given."""
        for p in phases:
            self.add(Phase(lane or p.lane, p.name, p.started, p.ended))

    def taken(self) -> tuple[Phase, ...]:
        with self._lock:
            return tuple(self.phases)

    # -- reporting ---------------------------------------------------------------------------

    def lines(self) -> list[str]:
        """One line per phase, in the order they started."""
        return [
            f"startup: [{p.lane}] {p.name}: {p.seconds:.2f} s "
            f"({self.at(p.started):.2f} -> {self.at(p.ended):.2f} s)"
            for p in sorted(self.taken(), key=lambda p: p.started)
        ]

    def summary(self) -> str:
        """Each lane's phases in one line: `worker: imports 3.1, database 0.2, ...`."""
        lanes: dict[str, list[str]] = {}
        for p in sorted(self.taken(), key=lambda p: p.started):
            lanes.setdefault(p.lane, []).append(f"{p.name} {p.seconds:.1f}")
        return "; ".join(f"{lane}: {', '.join(parts)}" for lane, parts in lanes.items())

    def log_ready(self) -> None:
        """The phases so far, then `ready at`: logged once, when the worker is ready."""
        if self.ready_at is not None:
            return
        self.ready_at = time.time()
        for line in self.lines():
            log.info("%s", line)
        log.info("startup: ready at %.2f s (%s)", self.at(self.ready_at), self.summary())

    def log_first_result(self) -> None:
        """`first result stored at`, once (after the first row stored as done)."""
        if self._first_result:
            return
        with self._lock:
            if self._first_result:
                return
            self._first_result = True
        now = time.time()
        after = f", {now - self.ready_at:.2f} s after ready" if self.ready_at is not None else ""
        log.info("startup: first result stored at %.2f s%s", self.at(now), after)


def uncached_bytecode(module: Any) -> str | None:
    """A warning when `module` was compiled from source at import and will be again at the next
    start: Python writes no bytecode (PYTHONDONTWRITEBYTECODE, common in container images) and
    none was written at install. On an H200 that made torch + transformers' import 11.4 s
    instead of 5.0, and a worker's start to its first result 17.6 s instead of 9.5
    (bench/results/startup/README.md)."""
    cached = getattr(module, "__cached__", None)
    if not sys.dont_write_bytecode or not cached or os.path.exists(cached):
        return None
    return (
        f"startup: {module.__name__} has no bytecode cache and Python writes none "
        "(PYTHONDONTWRITEBYTECODE): it is compiled from source at every start (on an H200 "
        "~8 s more to the first result); compile site-packages once at install "
        "(python -m compileall -q DIR) or unset PYTHONDONTWRITEBYTECODE"
    )


def parse(text: str) -> dict[str, Any]:
    """A worker log's start-up timeline, as `Timeline` logged it: `phases` (lane, name,
    seconds, start, end: seconds since the worker's process started), `ready_at_s` and
    `first_result_at_s` (None where the log has no such line). The first start's lines only,
    should the log hold a recycled worker's too."""
    phases: list[dict[str, Any]] = []
    ready = first = None
    for line in text.splitlines():
        if ready is None and (m := _PHASE_LINE.search(line)):
            phases.append({
                "lane": m["lane"], "name": m["name"], "seconds": float(m["seconds"]),
                "start": float(m["start"]), "end": float(m["end"]),
            })
        elif ready is None and (m := _READY_LINE.search(line)):
            ready = float(m["at"])
        elif first is None and (m := _FIRST_LINE.search(line)):
            first = float(m["at"])
    return {"phases": phases, "ready_at_s": ready, "first_result_at_s": first}
