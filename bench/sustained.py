"""Sustained throughput of a running loop, from what the loop itself reports at each harvest.

Why not "jobs finishing between the 10th and 90th percentile of finish times": with every job
queued at t=0 and a loop hundreds of rows deep, the rows that finish inside that window were
admitted before it opened, so the window counts work done outside it, and the figure moves with
the number of jobs queued (on an H200 the same A4 work "steadied" at 15.3 pages/s with 900 jobs
and 10.3 with 2,500). A sustained rate is completions per second while the loop is saturated:
from when it holds its full complement of rows (its slots, or as many as its KV budget takes)
until the waiting queue empties. Inside that window every completion frees a place that a
waiting row takes at once, so completions equal admissions and the rate is the loop's own; the
window opens only after the loop has turned over once, since the first cohort, admitted
together, finishes together.

The worker logs one line per harvest (ocrq/worker/runtime.py, `_log_batch`): when, how many
rows finished, how many wait for the loop and how many are in it. `harvests_from_log` reads
those lines; `sustained` is a pure function of them, tested on synthetic traces whose service
rate is known (tests/test_sustained_rate.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Harvest:
    """One harvest of the loop: `t` seconds since submission began, the rows that finished at
    it and their seconds in the loop (admission to finish, summed), the rows still waiting for
    the loop and the rows in it after the harvest."""

    t: float
    finished: int
    ran_s: float
    waiting: int
    in_flight: int


# Default fraction of the run's peak rows in flight that counts as "full": a loop bounded by
# its KV budget holds a few rows less or more as row lengths change.
FULL = 0.95

_LINE = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})[^\n]*?batch \w+: (\d+) images in [\d.]+ s "
    r"\(\d+ failed, predicted [\d.]+ GiB, (\d+) left waiting, (\d+) in flight, "
    r"([\d.]+) row-s\)"
)


def harvests_from_log(text: str, started: float) -> list[Harvest]:
    """The harvest lines of a worker's log, timed from `started` (epoch seconds, local time as
    the log prints it). A worker's own lines carry ocrq's format (`ocrq.worker.main.LOG_FORMAT`:
    Celery leaves the root logger alone); Celery's bracketed one is read too. Reading only the
    bracketed one made bench/lanes.py fall back to the finish window in every run."""
    out = []
    for m in _LINE.finditer(text):
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append(Harvest(at - started, int(m.group(2)), float(m.group(5)), int(m.group(3)),
                           int(m.group(4))))
    return out


def sustained(harvests: Sequence[Harvest], full: float = FULL) -> dict[str, Any] | None:
    """The loop's rate over its saturated window, or None when the run has no such window.

    The window opens once the loop, after first holding (nearly) its peak rows, has turned over
    once (as many rows have finished as it holds): before that the rows finishing are the first
    cohort, admitted together, whose finishes bunch or have not begun. It closes at the last
    harvest with rows still waiting; after it the loop drains. A run too short for both and for
    one more turnover between them (fewer than about three loops' worth of jobs) gets None
    rather than a biased figure.

    Inside the window the rate is given twice. `images_per_s` counts the completions in the
    window over its length: the definition itself. `little_images_per_s` is Little's law, rows
    held (mean over the window's harvests) over the mean seconds a row finishing in the window
    was held, as a cross-check. Each has its bias on short runs, in opposite cases: rows of
    near-equal length finish in waves, and a window holding a fraction of a wave puts the count
    a few per cent low while Little's law is exact; rows of very unequal length (crops beside
    pages) bias the rows finishing in a window towards short ones, which puts Little's law high
    while the count is exact (tests/test_sustained_rate.py shows both). Far apart, the run was
    too short for either."""
    if not harvests:
        return None
    peak = max(h.in_flight for h in harvests)
    if peak <= 0:
        return None
    full_at = next((i for i, h in enumerate(harvests) if h.in_flight >= full * peak), None)
    end = next((i for i in range(len(harvests) - 1, -1, -1) if harvests[i].waiting > 0), None)
    if full_at is None or end is None:
        return None
    turned, start = 0, None
    for i in range(full_at + 1, len(harvests)):
        turned += harvests[i].finished
        if turned >= peak:
            start = i
            break
    if start is None or end <= start:
        return None
    window = harvests[start + 1 : end + 1]
    done = sum(h.finished for h in window)
    ran = sum(h.ran_s for h in window)
    if done < peak or ran <= 0:  # less than one more turnover: too short to say
        return None
    span = harvests[end].t - harvests[start].t
    rows = sum(h.in_flight for h in window) / len(window)
    return {
        "images_per_s": done / span,
        "little_images_per_s": rows / (ran / done),
        "window_s": [harvests[start].t, harvests[end].t],
        "completions": done,
        "rows_in_loop_mean": rows,
        "seconds_in_loop_mean": ran / done,
        "peak_in_flight": peak,
    }


def finish_window(finish_times: Sequence[float]) -> tuple[float, float, float]:
    """The old estimator, kept for comparison only: jobs finishing between the 10th and 90th
    percentile finish, per second of that window (and the window)."""
    ts = sorted(finish_times)
    t0, t1 = ts[int(0.1 * (len(ts) - 1))], ts[int(0.9 * (len(ts) - 1))]
    inside = sum(t0 < t <= t1 for t in ts)
    return inside / max(t1 - t0, 1e-9), t0, t1
