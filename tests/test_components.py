"""Components: started in order, stopped in reverse, a failed start stops what had started.

The worker's runtime and the engine process are built from them (ocrq/core/components.py); the
tests below run the real parts (the rapid engine, its batcher, a heartbeat row in PostgreSQL,
the retention pass) and check the order and the unwinding on them.
"""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from ocrq.core import workers_table
from ocrq.core.components import Component, Components
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.engine_process import host as host_module
from ocrq.worker import runtime as runtime_module
from ocrq.worker.runtime import build_runtime


def _recorded(log: list[str], name: str, fail_start: bool = False,
              fail_stop: bool = False) -> Component:
    def start() -> None:
        if fail_start:
            raise RuntimeError(f"{name} cannot start")
        log.append(f"start {name}")

    def stop() -> None:
        log.append(f"stop {name}")
        if fail_stop:
            raise RuntimeError(f"{name} cannot stop")

    return Component(name, start, stop)


def test_started_in_order_and_stopped_in_reverse() -> None:
    log: list[str] = []
    parts = Components("test")
    parts.start([_recorded(log, n) for n in ("a", "b", "c")])
    assert parts.started == ["a", "b", "c"]
    parts.stop()
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    assert parts.started == []
    parts.stop()  # twice: nothing left to stop
    assert len(log) == 6


def test_a_failed_start_stops_those_started_and_raises() -> None:
    log: list[str] = []
    parts = Components("test")
    order = [_recorded(log, "a"), _recorded(log, "b"), _recorded(log, "c", fail_start=True),
             _recorded(log, "d")]
    with pytest.raises(RuntimeError, match="c cannot start"):
        parts.start(order)
    assert log == ["start a", "start b", "stop b", "stop a"]  # d never started
    assert parts.started == []


def test_a_failing_stop_still_stops_the_others_then_raises() -> None:
    log: list[str] = []
    parts = Components("test")
    parts.start([_recorded(log, "a"), _recorded(log, "b", fail_stop=True), _recorded(log, "c")])
    with pytest.raises(RuntimeError, match="b cannot stop"):
        parts.stop()
    assert log[3:] == ["stop c", "stop b", "stop a"]


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def _settings(broker_url: str, database_url: str, tmp_path: Path) -> Settings:
    return Settings(
        engine="rapid", broker_url=broker_url, database_url=database_url,
        profile_dir=tmp_path / "profiles", retention_days=30, heartbeat_s=5,
    )


def test_the_worker_runtime_starts_its_parts_in_order_and_stops_them_in_reverse(
    broker_url: str, database_url: str, tmp_path: Path
) -> None:
    settings = _settings(broker_url, database_url, tmp_path)
    db = create_engine(database_url)
    name = "components-order@test"
    runtime = build_runtime(settings, worker_name=name, liveness=True)
    try:
        assert runtime.components.started == ["engine", "heartbeat", "retention", "jobs"]
        assert name in workers_table.heartbeats(db)  # the heartbeat's row is there
        assert runtime.heartbeat is not None and runtime.retention is not None
    finally:
        runtime.close()
    assert runtime.components.started == []
    assert name not in workers_table.heartbeats(db)  # retired at the stop
    db.dispose()


def test_a_part_that_fails_to_start_stops_the_real_parts_before_it(
    broker_url: str, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job runner cannot be built (after the engine, the heartbeat and the retention pass
    started): the heartbeat row is retired, its thread and the retention pass's end, the
    batcher stops and the engine is closed, and the error reaches the caller."""
    settings = _settings(broker_url, database_url, tmp_path)
    db = create_engine(database_url)
    name = "components-unwind@test"
    sides: list[Any] = []
    real_load = runtime_module.load_engine
    monkeypatch.setattr(runtime_module, "load_engine", lambda s: sides.append(real_load(s))
                        or sides[-1])

    def no_runner(*args: object, **kwargs: object) -> None:
        assert name in workers_table.heartbeats(db)  # the heartbeat had started
        raise RuntimeError("the job runner cannot be built")

    monkeypatch.setattr(runtime_module, "JobRunner", no_runner)
    before = len(_threads("ocrq-batcher"))
    with pytest.raises(RuntimeError, match="job runner cannot be built"):
        build_runtime(settings, worker_name=name, liveness=True)
    assert name not in workers_table.heartbeats(db)
    assert not _threads("ocrq-heartbeat") and not _threads("ocrq-retention")
    assert len(_threads("ocrq-batcher")) == before
    assert sides and sides[0].engine._det is None  # the rapid engine was closed
    db.dispose()


def test_the_engine_process_unwinds_a_failed_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its preprocessing threads cannot start (no threads: ThreadPoolExecutor refuses): the
    batcher that had started stops and the engine is closed."""
    sides: list[Any] = []
    real_load = host_module.load_engine
    monkeypatch.setattr(host_module, "load_engine", lambda s: sides.append(real_load(s))
                        or sides[-1])
    monkeypatch.setattr(host_module, "prepare_threads", lambda: 0)
    ours, theirs = Pipe(duplex=True)
    before = len(_threads("ocrq-batcher"))
    with pytest.raises(ValueError, match="max_workers"):
        host_module.EngineHost(Settings(engine="rapid", profile_dir=tmp_path), theirs)
    assert len(_threads("ocrq-batcher")) == before
    assert sides and sides[0].engine._det is None
    ours.close()
    theirs.close()


def test_a_runtime_without_liveness_has_no_heartbeat(tmp_path: Path) -> None:
    """Embedded mode and tests: the engine and the jobs, no heartbeat row, no retention."""
    store = JobStore(get_engine(f"sqlite:///{tmp_path / 'jobs.sqlite'}"))
    runtime = build_runtime(Settings(engine="rapid", profile_dir=tmp_path), store=store)
    try:
        assert runtime.components.started == ["engine", "jobs"]  # no liveness asked
    finally:
        runtime.close()
