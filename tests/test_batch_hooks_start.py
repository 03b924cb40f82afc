"""A worker's batch webhooks look at the broker's Redis once as they start (webhooks an older
ocrq kept there are moved to PostgreSQL). With the broker away that look fails: said in one
line naming the error, not a traceback per start (the broker's wait is said once, with its URL,
by ocrq/worker/broker.py)."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import create_engine

from ocrq.core.settings import Settings
from ocrq.worker.batch_hooks import BatchHooks
from tests.servers import free_port


def test_a_broker_away_at_start_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(_env_file=None, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    hooks = BatchHooks(settings, create_engine("sqlite://"), lambda: None)  # type: ignore[arg-type,return-value]
    with caplog.at_level(logging.WARNING, logger="ocrq.worker.batch_hooks"):
        hooks._adopt_legacy()
    (record,) = [r for r in caplog.records if "batch webhooks" in r.getMessage()]
    assert record.exc_info is None, record
    assert "ConnectionError" in record.getMessage() and "next start" in record.getMessage()
