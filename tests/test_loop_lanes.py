"""The interactive lane inside the running loop (ocrq/models/loop/lane_pass.py), on the CPU with the
tiny HunyuanOCR model: an interactive row arriving while every bulk slot is taken is prefilled
in the very next pass (a reserved slot), ahead of bulk rows queued before it; without the
reserve it waits for a bulk row to end. The engine opens its reserved slots on top of
OCRQ_MAX_BATCH and tells the loop each row's lane; the loop's per-lane figures count it.
"""

from __future__ import annotations

from typing import Any

import pytest

from ocrq.models.costs import CostModel
from ocrq.models.hunyuan import HunyuanLoopEngine
from ocrq.models.hunyuan.loop_types import LoopRow
from ocrq.models.hunyuan.running import RunningLoop
from ocrq.models.loop.lane_pass import LanePolicy
from ocrq.models.slots import RunningBudget
from tests.tiny_hunyuan import cpu_settings, item, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

MAX_NEW = 24
BULK_SLOTS = 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HunyuanLoopEngine:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.5")
    eng = HunyuanLoopEngine(
        cpu_settings(str(path), MAX_NEW, max_batch=BULK_SLOTS, interactive_slots=1),
        decode="fast",
    )
    eng.load()
    return eng


def loop_of(engine: HunyuanLoopEngine, reserved: int, **lanes: Any) -> RunningLoop:
    assert engine._decoder is not None and engine.tokens is not None
    budget = RunningBudget(BULK_SLOTS + reserved, 8192, 4096, 0, 0, 0, 0, reserved)
    config = engine.loop_config(budget, lanes=LanePolicy(reserved_slots=reserved, **lanes))
    return RunningLoop(engine._decoder, engine.tokens, config)


def row(engine: HunyuanLoopEngine, seed: int, cap: int, interactive: bool = False) -> LoopRow:
    it = item(64, 64, seed)
    return LoopRow(it.key, engine.preprocess(it), cap, min_new_tokens=cap,
                   interactive=interactive)


def fill_with_bulk(engine: HunyuanLoopEngine, loop: RunningLoop) -> None:
    """Every bulk slot holds a long row and two more bulk rows wait for one."""
    loop.add([row(engine, 10 + i, MAX_NEW) for i in range(BULK_SLOTS + 2)])
    loop.run(timeout_s=0)  # one pass, one step
    assert loop.live == BULK_SLOTS and len(loop.waiting) == 2


@pytest.mark.parametrize("reserved", [1, 0])
def test_an_interactive_row_goes_in_the_next_pass_of_a_loop_full_of_bulk(
    engine: HunyuanLoopEngine, reserved: int
) -> None:
    loop = loop_of(engine, reserved)
    fill_with_bulk(engine, loop)
    loop.add([row(engine, 99, 3, interactive=True)])
    assert [r.key for r in loop.waiting] == ["img13", "img14", "img99"]
    loop.run(timeout_s=0)  # the next pass
    live = {r.key for r in loop.rows.values()}
    if reserved:
        assert "img99" in live and loop.live == BULK_SLOTS + 1
        assert [r.key for r in loop.waiting] == ["img13", "img14"]  # bulk still waits its turn
        assert loop.stats.prefilled_interactive == 1 and loop.stats.lane_steps == 1
    else:  # the loop is full: it waits for a bulk row to end, MAX_NEW steps away
        assert "img99" not in live and loop.live == BULK_SLOTS
        assert loop.stats.prefilled_interactive == 0
    done = {d.row.key: d for d in loop.drain()}
    assert {k: len(d.tokens) for k, d in done.items()} == {
        **{f"img{10 + i}": MAX_NEW for i in range(BULK_SLOTS + 2)}, "img99": 3
    }
    assert loop.pool.free_tokens == 8192  # every range given back
    stats = loop.collect_stats(wait=True)
    assert stats.prefilled_interactive == 1
    assert stats.interactive_row_steps == 3 - 1  # its first token comes from the prefill
    assert stats.kv_token_steps > stats.row_steps  # each live row reads its prompt at least


def test_while_the_lane_is_busy_bulk_passes_keep_to_the_gap(engine: HunyuanLoopEngine) -> None:
    """Bulk rows freed by a finishing row wait `bulk_gap` steps since the last bulk pass while an
    interactive row decodes; with no interactive row they go in at once."""
    def first_step_of_the_last_bulk_row(interactive: bool) -> int:
        loop = loop_of(engine, 1, bulk_gap=10)
        last = row(engine, 23, MAX_NEW)
        fifth = row(engine, 30, 16, interactive=interactive)
        loop.add([row(engine, 20, 2), row(engine, 21, MAX_NEW), row(engine, 22, MAX_NEW), last,
                  fifth])
        loop.drain()
        # At step 0: three bulk rows, and the fifth if interactive (a reserved slot); as bulk
        # it waits for a fourth bulk slot (none: img23 takes img20's).
        assert (fifth.first_step == 0) is interactive
        return last.first_step

    # img20 ends after 2 tokens (step 1); OCRQ_PREFILL_GAP_STEPS (4) puts img23 in at step 4,
    # unless the interactive row decoding (to step 15) holds it to the bulk gap: step 10.
    assert first_step_of_the_last_bulk_row(interactive=False) == 4
    assert first_step_of_the_last_bulk_row(interactive=True) == 10


def test_the_engine_opens_the_reserve_and_tells_the_loop_each_rows_lane(
    engine: HunyuanLoopEngine,
) -> None:
    per_token = engine.cost_model().per_cache_token_bytes
    engine.open(2**24, CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token))
    try:
        running, loop = engine.running, engine.loop
        assert running is not None and loop is not None
        assert running.slots == BULK_SLOTS + 1 and running.reserved_slots == 1
        assert loop.config.lanes.reserved_slots == 1
        fast, slow = item(64, 64, 60), item(64, 64, 61)
        fast.priority, fast.max_new_tokens = "interactive", 2
        engine.submit([slow, fast])
        assert [r.interactive for r in loop.waiting] == [False, True]
        got: dict[str, Any] = {}
        while len(got) < 2:
            for f in engine.poll(1.0):
                got[f.key] = f.resolve()
        counts = engine.loop_counts()
        assert counts["prefilled_interactive"] == 1 and counts["lane_steps"] >= 1
    finally:
        engine.reset()


def test_a_dropped_waiting_interactive_row_leaves_the_lane_idle(engine: HunyuanLoopEngine) -> None:
    """A cancelled interactive row still waiting (RunningLoop.drop) no longer makes the lane
    busy: the bulk passes after it are neither rushed nor counted as the lane's."""
    loop = loop_of(engine, 0)  # no reserve: the interactive row waits behind a full loop
    fill_with_bulk(engine, loop)
    loop.add([row(engine, 98, 3, interactive=True)])
    assert [r.key for r in loop.drop({"img98"})] == ["img98"]
    assert [r.key for r in loop.waiting] == ["img13", "img14"]
    done = loop.drain()
    assert sorted(d.row.key for d in done) == [f"img{10 + i}" for i in range(BULK_SLOTS + 2)]
    stats = loop.collect_stats(wait=True)
    assert stats.prefills >= 2 and stats.lane_prefills == 0 and stats.lane_prefill_s == 0.0
    assert stats.prefilled_interactive == 0
