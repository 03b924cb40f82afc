"""bench/lanes_sim.py drives the running loop's own scheduler through a modelled card: every row
ends exactly once, at a time the model can account for, and the lane rule it is handed is the
one that decides (a promotion after 0 s ranks the whole held backlog with the stream)."""

from __future__ import annotations

from dataclasses import replace

from bench.lanes_sim import CARDS, Row, default_policy, scheduler_config, simulate
from bench.service_gpu import Job


def rows(bulk: int, stream: int, rate: float) -> list[Row]:
    made = [Row(Job(f"b{i}", "x", "parse", "a4", 300 + 37 * (i % 9)), False, 0.0, 1200)
            for i in range(bulk)]
    made += [Row(Job(f"i{i}", "x", "text", "svt_word", 6), True, 1.0 + i / rate, 300)
             for i in range(stream)]
    return made


def test_every_row_ends_once_and_no_sooner_than_its_tokens_allow() -> None:
    card = CARDS["h200"]
    config = scheduler_config(card, 2048, default_policy())
    made = rows(300, 20, 2.0)
    end, stats = simulate(made, config, card, held=120)
    assert all(r.finished is not None for r in made)
    step_s = min(card.step_fixed_ms, card.extra_step_ms) / 1000
    for r in made:  # its pass, then a step for each token after the first at the least
        floor = card.pass_ms(r.prompt_tokens) / 1000 + (r.job.new_tokens - 1) * step_s
        assert r.finished - r.arrives >= floor - 1e-9
    assert end >= max(r.finished for r in made)
    # every row had its pass; the clock is the passes and the steps, nothing else
    assert stats["passes"] >= 1 and stats["steps"] >= max(r.job.new_tokens for r in made) - 1
    busy = stats["pass_s"] + stats["step_s"] + stats["extra_steps"] * card.extra_step_ms / 1000
    assert busy <= end + 1e-6


def test_the_lane_rule_handed_in_decides_the_interactive_wait() -> None:
    card = CARDS["h200"]
    waits = {}
    for wait_s in (0.0, 600.0):
        config = scheduler_config(card, 2048, replace(default_policy(), bulk_max_wait_s=wait_s))
        made = rows(400, 20, 2.0)
        simulate(made, config, card, held=400)
        lat = sorted(r.finished - r.arrives for r in made if r.interactive)
        waits[wait_s] = lat[len(lat) // 2]
    # Promoted at once, every held bulk row is older than the stream and goes first.
    assert waits[0.0] > 3 * waits[600.0]
