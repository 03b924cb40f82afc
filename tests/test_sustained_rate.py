"""The sustained-throughput estimator of the GPU benches (bench/sustained.py), on synthetic
traces of a deep running loop whose service rate is known.

The simulated loop holds `slots` rows; every step each row makes one token and leaves at its
length; free slots take up to `per_step` waiting rows a step (a loop fills over many steps).
Its rate while full is slots / (mean length x step): the figure a sustained estimator must
give, whatever the number of jobs queued. The old "10th to 90th percentile of finish times"
window is shown wrong on the same trace.
"""

from __future__ import annotations

import random
from statistics import mean

import pytest

from bench.sustained import Harvest, finish_window, harvests_from_log, sustained

STEP_S = 0.04


def trace(jobs: int, lengths: tuple[int, int] | None, slots: int = 512, per_step: int = 64,
          seed: int = 0) -> tuple[list[Harvest], list[float], float]:
    """`lengths`: uniform in that range, or None for `service_mix`."""
    rng = random.Random(seed)
    waiting = [rng.randint(*lengths) if lengths else service_mix(rng) for _ in range(jobs)]
    original = list(waiting)
    live: list[tuple[int, float]] = []  # (tokens left, admitted at)
    harvests, finishes, t = [], [], 0.0
    while waiting or live:
        t += STEP_S
        live = [(left - 1, at) for left, at in live]
        done = [at for left, at in live if left == 0]
        live = [(left, at) for left, at in live if left > 0]
        finishes += [t] * len(done)
        room = min(slots - len(live), per_step, len(waiting))
        live += [(n, t) for n in waiting[:room]]
        waiting = waiting[room:]
        harvests.append(Harvest(t, len(done), sum(t - at for at in done), len(waiting),
                                len(live)))
    return harvests, finishes, slots / (mean(length for length in original) * STEP_S)


# Near-equal lengths (the A4 bench's scripted ~1,070 tokens), a wider spread, and a mix of
# 3-token crops and long pages.
LENGTHS = [(1000, 1140), (600, 1500), (3, 1500)]


def service_mix(rng: random.Random) -> int:
    """Lengths like the service bench's mix: 15% A4 pages, the rest crops, lines, receipts."""
    u = rng.random()
    if u < 0.15:
        return rng.randint(1000, 1140)
    return rng.randint(3, 12) if u < 0.45 else rng.randint(50, 400)


@pytest.mark.parametrize("lengths", [*LENGTHS, None])
@pytest.mark.parametrize("jobs", [2500, 6000])
def test_sustained_rate_is_the_loops_rate_whatever_the_queue(
    lengths: tuple[int, int] | None, jobs: int
) -> None:
    harvests, _, rate = trace(jobs, lengths)
    got = sustained(harvests)
    assert got is not None
    assert got["images_per_s"] == pytest.approx(rate, rel=0.05)
    assert got["peak_in_flight"] == 512
    assert got["completions"] > 0


def test_the_cross_check_and_its_bias() -> None:
    """Little's law is exact on near-equal lengths and reads high on the service's mix."""
    narrow, _, rate = trace(2500, (1000, 1140))
    got = sustained(narrow)
    assert got is not None and got["little_images_per_s"] == pytest.approx(rate, rel=0.01)
    mixed, _, rate = trace(2500, None, slots=256, per_step=10)
    got = sustained(mixed)
    assert got is not None
    assert got["images_per_s"] == pytest.approx(rate, rel=0.03)
    assert got["little_images_per_s"] > 1.04 * rate


def test_the_finish_window_is_biased_where_the_sustained_rate_refuses() -> None:
    """900 A4-like jobs on a 512-row loop: the old window reports ~1.3x the loop's rate, and
    the run never reaches a saturated window at all, which the new estimator says (None)."""
    harvests, finishes, rate = trace(900, (1000, 1140))
    old, _, _ = finish_window(finishes)
    assert old > 1.25 * rate
    assert sustained(harvests) is None
    # Its figure moves with the number of jobs queued; the sustained one does not.
    h2500, f2500, _ = trace(2500, (1000, 1140))
    h6000, _, _ = trace(6000, (1000, 1140))
    assert abs(finish_window(finishes)[0] / finish_window(f2500)[0] - 1) > 0.2
    a, b = sustained(h2500), sustained(h6000)
    assert a is not None and b is not None
    assert a["images_per_s"] == pytest.approx(b["images_per_s"], rel=0.03)


def test_harvest_lines_are_read_from_a_worker_log() -> None:
    log = (
        "[2026-12-01 10:00:01,500: INFO/MainProcess] batch 1a2b3c4d: 3 images in 0.120 s "
        "(0 failed, predicted 1.250 GiB, 40 left waiting, 512 in flight, 31.5 row-s)\n"
        "[2026-12-01 10:00:02,000: INFO/MainProcess] something else\n"
        "[2026-12-01 10:00:02,250: INFO/MainProcess] batch 5e6f7a8b: 0 images in 0.010 s "
        "(0 failed, predicted 1.250 GiB, 0 left waiting, 509 in flight, 0.0 row-s)\n"
    )
    from datetime import datetime

    t0 = datetime(2026, 12, 1, 10, 0, 0).timestamp()
    got = harvests_from_log(log, t0)
    assert got == [Harvest(1.5, 3, 31.5, 40, 512), Harvest(2.25, 0, 0.0, 0, 509)]


@pytest.mark.parametrize("fmt", ["ocrq", "celery"])
def test_the_workers_own_harvest_line_is_read(
    caplog: pytest.LogCaptureFixture, fmt: str
) -> None:
    """The line the worker really logs (ocrq/worker/runtime.py), in the format its log has it:
    ocrq's own (Celery does not take the root logger over), and Celery's worker format."""
    import logging
    import time as _time

    from ocrq.core.settings import Settings
    from ocrq.scheduling.vocabulary import BatchRecord
    from ocrq.worker import runtime
    from ocrq.worker.celery_app import make_app
    from ocrq.worker.main import LOG_FORMAT

    record = BatchRecord("0123456789", 7, 1.0, 1.25, 2**30, 0, 0, 2**31, 12, in_flight=300,
                         row_seconds=42.25)
    with caplog.at_level(logging.INFO, logger=runtime.log.name):
        runtime._log_batch(record)
    formatter = logging.Formatter(
        LOG_FORMAT if fmt == "ocrq" else make_app(Settings()).conf.worker_log_format
    )
    line = formatter.format(caplog.records[-1])
    now = _time.time()
    got = harvests_from_log(line, now)
    assert len(got) == 1
    assert (got[0].finished, got[0].ran_s, got[0].waiting, got[0].in_flight) == (7, 42.2, 12, 300)
    assert abs(got[0].t) < 5
