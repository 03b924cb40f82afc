"""A refused URL image: the job's error stays generic (it reaches producers), and the reason is
an INFO line in the worker's own log; it was at DEBUG only, so an operator never saw why."""

from __future__ import annotations

import logging

import pytest

from ocrq.core.settings import Settings
from ocrq.intake.fetch import FetchError, fetch


def test_the_refusal_reason_is_an_info_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ocrq.intake.fetch")
    with pytest.raises(FetchError) as refused:
        fetch("http://127.0.0.1:9/x.png", Settings(url_allow_networks=[]))  # type: ignore[arg-type]
    assert "resolves to" not in str(refused.value)  # the producer sees no reason
    lines = [r for r in caplog.records if r.levelno == logging.INFO and "not fetched" in r.message]
    assert len(lines) == 1 and "resolves to 127.0.0.1" in lines[0].getMessage(), caplog.records
