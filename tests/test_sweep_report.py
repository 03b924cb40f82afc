"""A recovery sweep that fails part-way still reports the messages it had put back (issue 31).

Why: the put-back moves a dead worker's unstarted message back to the queue; if the sweep's
next step (flipping stalled rows, in the database) then failed, the whole sweep was logged as
failed and the put-back never said, and a later sweep cannot find that message again to say
so: the fault loop saw an ETA job recovered with no "re-sent" line. The put-back itself runs
for real in tests/test_recovery.py (a worker killed holding a message); here the database
failing mid-sweep is the one part stood in for, with a real Redis and a real broker view.
"""

from __future__ import annotations

import logging

import pytest
from sqlalchemy.exc import OperationalError

from ocrq.core import requeue
from ocrq.core.db import get_engine
from ocrq.core.requeue import producer_app, recover
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.worker.heartbeat import Heartbeat


def test_a_sweep_failing_after_its_put_back_still_reports_it(
    broker_url: str, database_url: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = Settings(broker_url=broker_url, database_url=database_url, queue="ocr-sweep-rep")
    store = JobStore(get_engine(database_url))
    app = producer_app(settings)
    gone = OperationalError("UPDATE jobs ...", {}, Exception("server closed the connection"))

    def put_back(*_: object) -> list[str]:
        return ["job-held-by-a-dead-worker"]

    def flip(*_: object, **__: object) -> list[str]:
        raise gone

    monkeypatch.setattr(requeue, "_restore_orphans", put_back)
    monkeypatch.setattr(requeue, "_resend_stalled", flip)
    found = recover(store, app, settings, paced=False)
    assert found.orphaned == ["job-held-by-a-dead-worker"] and found.failed is gone

    beat = Heartbeat(store.engine, "w-sweep-report", settings,
                     sweep=lambda: recover(store, app, settings, paced=False))
    with caplog.at_level(logging.WARNING, logger="ocrq.worker.heartbeat"):
        beat._run_sweep()
    said = caplog.text
    assert "re-sent 1 job(s) dead workers had taken but not started" in said, said
    assert "job-held-by-a-dead-worker" in said and "failed part-way" in said, said
    # `ocrq requeue --stalled` fails loudly, after saying what it put back.
    with pytest.raises(OperationalError):
        requeue.requeue_stalled(store, app, settings)
