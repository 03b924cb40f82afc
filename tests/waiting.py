"""Waiting on conditions in fault tests, within a budget that fits under pytest's timeout.

A fault test waits for several things in turn (a worker ready, jobs running, a sweep, every row
final). Each wait used to carry its own generous timeout, and on a loaded 2-core CI machine
those added up to more than pytest's 600 s (pyproject `timeout`): pytest then killed the test
with a bare stack and no word of what was still awaited. Here a test declares its whole budget
once (checked against that timeout), every wait takes its slice from it, and a wait that runs
out says what it waited for, how long, and what it saw last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PYTEST_TIMEOUT_S = 600.0  # pyproject.toml [tool.pytest.ini_options] timeout
# Left for what is not a wait: start-up, warm shutdowns in `finally`, the assertions.
MARGIN_S = 90.0


class WaitTimeout(TimeoutError):
    """A condition a fault test waited for did not come true within its slice of the budget
    (a TimeoutError, so callers that fall back on one, e.g. to `ocrq requeue`, still do)."""


class Budget:
    """The seconds a test may spend waiting, all its waits together."""

    def __init__(self, total_s: float, name: str, checked: bool = True) -> None:
        """`checked=False`: one wait of a test that declares no budget of its own."""
        if checked and total_s > PYTEST_TIMEOUT_S - MARGIN_S:
            raise ValueError(
                f"{name}: a wait budget of {total_s:.0f} s leaves less than {MARGIN_S:.0f} s "
                f"under pytest's {PYTEST_TIMEOUT_S:.0f} s timeout"
            )
        self.name = name
        self.deadline = time.monotonic() + total_s
        self.total_s = total_s

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def until(
        self,
        what: str,
        condition: Callable[[], T | None],
        timeout: float,
        detail: Callable[[], str] | None = None,
        poll_s: float = 0.2,
    ) -> T:
        """`condition()`'s first truthy value, polled for at most `timeout` s (less if the
        budget has less left). Out of time: WaitTimeout naming `what` and `detail()`."""
        allowed = min(timeout, self.left())
        started = time.monotonic()
        end = started + allowed
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() >= end:
                break
            time.sleep(poll_s)
        seen = detail() if detail is not None else ""
        raise WaitTimeout(
            f"[{self.name}] waited {time.monotonic() - started:.0f} s (slice {timeout:.0f} s, "
            f"budget {self.total_s:.0f} s) for {what}" + (f"\n{seen}" if seen else "")
        )
