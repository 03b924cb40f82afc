"""Worker liveness and readiness, decided from the worker's own health gauges.

Why from gauges: under the supervisor the process answering probes is not the one running the
engine. The worker process publishes a few gauges (ocrq/core/metrics.py: ready, started,
heartbeat tick, batch running since) and whoever serves /healthz and /readyz reads them back
from a registry: its own, or the supervisor's multiprocess one. The decision is a pure function
of those values and the clock, so it is tested without threads or processes.

- live: the process is starting (engine still loading), or its heartbeat thread ticked within
  `stale_after_s` and no batch has run longer than `hung_after_s`. A database outage does not
  make a worker dead (restarting it would not help): the tick counts, not the database's answer.
- ready: live, the engine loaded and consuming (set at Celery's worker_ready after the model
  loaded; cleared at shutdown), and the database schema at Alembic head (checked by the server
  when probed, since a newer deploy may migrate under a running worker). Not ready, it says
  what the start waits for: the database (its own gauge, set while the start-up check waits),
  the broker (set at a failed connection attempt, cleared at a successful one) or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.registry import Collector

GAUGES = {
    "ocrq_worker_ready": "ready",
    "ocrq_worker_started_timestamp_seconds": "started_at",
    "ocrq_worker_heartbeat_timestamp_seconds": "heartbeat_at",
    "ocrq_batch_running_since_timestamp_seconds": "batch_since",
    "ocrq_worker_database_wait_since_timestamp_seconds": "database_wait_since",
    "ocrq_worker_broker_wait_since_timestamp_seconds": "broker_wait_since",
}


@dataclass(frozen=True)
class WorkerState:
    """The health gauges of the live worker process (None or 0: it has not set them)."""

    ready: float | None = None
    started_at: float | None = None
    heartbeat_at: float | None = None
    batch_since: float | None = None
    database_wait_since: float | None = None
    broker_wait_since: float | None = None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str

    def as_json(self) -> dict[str, object]:
        return {"status": "ok" if self.ok else "fail", "reason": self.reason}


def read_state(collectors: Iterable[Collector]) -> WorkerState:
    values: dict[str, float] = {}
    for collector in collectors:
        for family in collector.collect():
            for sample in family.samples:
                if sample.name in GAUGES:
                    values[GAUGES[sample.name]] = sample.value
    return WorkerState(**values)


def liveness(state: WorkerState, now: float, stale_after_s: float, hung_after_s: float) -> Verdict:
    if not state.started_at:  # None or 0: a gauge never set reads 0
        return Verdict(True, "worker process starting")
    if not state.heartbeat_at:
        if state.database_wait_since:
            return Verdict(True, "waiting for the database")
        return Verdict(True, "waiting for the broker" if state.broker_wait_since
                       else "engine loading")
    silent = now - state.heartbeat_at
    if silent > stale_after_s:
        return Verdict(False, f"heartbeat thread silent for {silent:.0f} s")
    if state.batch_since:
        running = now - state.batch_since
        if running > hung_after_s:
            return Verdict(False, f"batch running for {running:.0f} s")
    return Verdict(True, "heartbeat ticking")


def readiness(
    state: WorkerState, live: Verdict, schema_error: str | None, broker: str = "OCRQ_BROKER_URL"
) -> Verdict:
    """`broker`: how a wait for the broker names it (`OCRQ_BROKER_URL=<the URL, redacted>`)."""
    if not live.ok:
        return live
    if not state.ready:
        return Verdict(False, _not_ready_reason(state, broker))
    if schema_error is not None:
        return Verdict(False, schema_error)
    return Verdict(True, "engine loaded, schema at head")


def _not_ready_reason(state: WorkerState, broker: str) -> str:
    """What a starting worker waits for. The database check runs beside the engine's load and
    Celery starts only after both: while it waits (a database still starting, or unreachable
    for up to a minute), "engine not loaded yet" sent operators to look at the engine. So did
    a broker Celery cannot reach, for as long as it retries (for ever), the engine long loaded;
    the URL is named since a wrong host or port in it is the usual cause."""
    if not state.started_at:
        return "no worker process"
    if state.database_wait_since:
        return "waiting for the database (OCRQ_DATABASE_URL)"
    if state.broker_wait_since:
        return f"waiting for the broker ({broker})"
    return "engine not loaded yet"
