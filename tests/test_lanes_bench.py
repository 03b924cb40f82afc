"""bench/lanes.py reads the running loop's step figures per run from the worker's log: the
`running loop totals:` lines the streaming batcher writes (ocrq/scheduling/streaming.py), in
both formats a worker log holds them (Celery's, for the loop in the worker; the engine
process's own)."""

from __future__ import annotations

import json
import logging
import time

from bench.lanes import (
    loop_figures,
    loop_totals,
    loop_window,
    q,
    ratio_interval,
    waiting_gauges,
)

CELERY = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"
ENGINE = "%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"  # engine_process/host.py


def line(fmt: str, at: float, totals: dict[str, float]) -> str:
    record = logging.LogRecord("ocrq.scheduling.streaming", logging.INFO, __file__, 1,
                               "running loop totals: %s", (json.dumps(totals),), None)
    record.created, record.msecs = at, (at % 1) * 1000
    return logging.Formatter(fmt).format(record)


def test_the_bench_reads_the_loops_totals_and_says_what_a_lane_token_cost() -> None:
    started = time.time() - 100
    first = {"steps": 100, "decode_seconds": 0.5, "prefill_seconds": 0.5, "prefills": 10,
             "prefill_tokens": 20000, "row_steps": 25600, "lane_steps": 40,
             "lane_decode_seconds": 0.4, "lane_prefill_seconds": 0.4, "lane_prefills": 8}
    second = {k: 2 * v for k, v in first.items()}
    text = "\n".join([
        "[2026-12-02 06:00:00,000: INFO/MainProcess] batch 1234abcd: 3 images in 0.1 s",
        line(CELERY, started + 10, first),
        "some other line",
        line(ENGINE, started + 20, second),
    ])
    lines = loop_totals(text, started)
    assert [round(t, 1) for t, _ in lines] == [10.0, 20.0]
    assert lines[1][1] == second
    f = loop_figures(second)
    assert f["step_ms"] == 5.0 and f["rows_per_step"] == 256.0 and f["pass_ms"] == 50.0
    # 0.8 s of the lane's steps and 0.8 s of passes between them over 80 steps: 20 ms a token;
    # the other 120 steps: 0.2 s of steps and 0.2 s of passes, 3.333 ms.
    assert f["lane_token_ms"] == 20.0 and f["other_token_ms"] == 3.333
    window = loop_window(lines, 5, 25)
    assert window is not None and window["steps"] == 100 and window["lane_token_ms"] == 20.0
    assert loop_window(lines, 15, 25) is None  # one line: no difference to take


def test_the_waiting_gauges_are_read_as_levels_not_totals() -> None:
    """`waiting_now` / `held_now` are levels the batcher writes beside the totals: the bench
    summarises them and never takes their difference as if they were counts."""
    started = time.time() - 100
    totals = {"steps": 10, "decode_seconds": 0.1}
    text = "\n".join(line(CELERY, started + t, {**totals, "waiting_now": w, "held_now": h})
                     for t, w, h in [(5, 400, 20), (10, 100, 0), (15, 300, 0)])
    lines = loop_totals(text, started)
    g = waiting_gauges(lines)
    assert g["waiting_now"] == {"mean": 266.7, "p50": 300, "max": 400, "n": 3}
    assert g["held_now"]["max"] == 20
    window = loop_window(lines, 0, 20)
    assert window is not None and "waiting_now" not in window
    assert window["waiting"]["waiting_now"]["max"] == 400


def test_a_latency_ratio_comes_with_its_bootstrap_interval() -> None:
    """64 jobs: the p95 is their third slowest, so one slow job moves it; the interval says how
    far. A stream 3x slower everywhere is 3x at the centre; a few slow jobs widen it."""
    alone = [0.2 + 0.01 * i for i in range(64)]
    mixed = [3 * x for x in alone]
    low, high = ratio_interval(mixed, alone, 0.95)
    assert low <= round(q(mixed, 0.95) / q(alone, 0.95), 2) <= high
    assert low > 2.5 and high < 3.5
    spiky = [*mixed[:-5], *[30.0] * 5]  # five slow jobs: the p95 sits on them, or not
    s_low, s_high = ratio_interval(spiky, alone, 0.95)
    assert s_high > 10 and s_low < s_high / 3
    assert ratio_interval([], alone, 0.95) is None
