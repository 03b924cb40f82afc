"""Deferred prefill commits (`LoopConfig.prefill_stream`, ocrq/models/hunyuan/passes.py) on the
CPU with the tiny HunyuanOCR 1.5.

On a GPU a pass runs on a side stream and the loop commits it at the first iteration that finds
its event done, decode steps going on meanwhile. CUDA events cannot run here, so the tests hold a
pass pending for `hold` loop iterations (`PrefillPasses.hold`): the host's books then go through
what the GPU's timing makes them go through. Every row must come back once with the tokens (and
logits) the immediate loop gives it; rows of a pending pass dropped or cleared must neither be
lost nor come back; and an interactive row still goes in the next pass of a loop full of bulk.
`EagerLoop`, which makes a pass's rows live before their commit, shows the comparison can fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from ocrq.models.hunyuan import HunyuanLoopEngine
from ocrq.models.hunyuan.loop_types import LoopRow
from ocrq.models.hunyuan.runner import LoopRunner
from ocrq.models.hunyuan.running import RunningLoop
from ocrq.models.loop.lane_pass import LanePolicy
from ocrq.models.slots import KvPool, RunningBudget
from tests.tiny_hunyuan import cpu_settings, item, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

MAX_NEW = 24
TOLERANCE = 1e-3  # fp32 on the CPU: rows stepped beside different rows differ by ~1e-6
CAPS = [1, MAX_NEW, 2, 17, 5, MAX_NEW, 3, 9, 4, 11]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HunyuanLoopEngine:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.5")
    eng = HunyuanLoopEngine(cpu_settings(str(path), MAX_NEW, interactive_slots=1), decode="fast")
    eng.load()
    return eng


class EagerLoop(LoopRunner):
    """Makes a deferred pass's rows live at its launch, before their slots' state is written:
    the steps in between see them finished, and the rows come back wrong."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        launch = self.passes.run

        def eager(rows: list[LoopRow], busy: bool) -> None:
            launch(rows, busy)
            pending = self.passes.pending
            if pending is not None and pending.looks == 0:
                for r in pending.rows:
                    if r.slot not in self.rows:
                        r.first_step = self.books.step_no
                        self.books.enter(r)
                        self.harvest.track(r)

        self.passes.run = eager  # type: ignore[method-assign]


def batch(engine: HunyuanLoopEngine) -> list[LoopRow]:
    items = [item(64 + 12 * i, 64 + 20 * (i % 3), 60 + i) for i in range(len(CAPS))]
    return [LoopRow(it.key, engine.preprocess(it), cap, min_new_tokens=cap)
            for it, cap in zip(items, CAPS, strict=True)]


def make_loop(engine: HunyuanLoopEngine, rows: list[LoopRow], hold: int | None,
              cls: type = LoopRunner, **extra: Any) -> RunningLoop:
    """3 slots, a pool of two of the largest rows; `hold`: None, the immediate loop; else
    deferred commits, each pass held pending that many iterations."""
    assert engine._decoder is not None and engine.tokens is not None
    pool = 2 * (max(r.prompt_tokens for r in rows) + MAX_NEW) + 32
    config = engine.loop_config(
        RunningBudget(3, pool, 4096, 0, 0, 0, 0), schedule="chunked", chunk_tokens=256,
        check_every=2, prefill_stream=hold is not None, keep_logits=True,
        lanes=LanePolicy(), **extra,
    )
    loop = RunningLoop(engine._decoder, engine.tokens, config, runner=cls)
    loop.runner.passes.hold = hold or 0
    return loop


def drained(loop: RunningLoop) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for d in loop.drain():
        assert d.row.key not in got, "a row handed back twice"
        got[d.row.key] = d
    assert loop.idle() and loop.runner.passes.pending is None
    assert loop.pool == KvPool.empty(loop.config.pool_tokens)  # every range given back
    return got


def run_all(engine: HunyuanLoopEngine, hold: int | None, cls: type = LoopRunner
            ) -> tuple[dict[str, Any], RunningLoop]:
    loop = make_loop(engine, batch(engine), hold, cls)
    loop.add(batch(engine))
    return drained(loop), loop


def same_rows(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert g.tokens == w.tokens, key
        assert g.logits.shape == w.logits.shape, key
        assert float((g.logits - w.logits).abs().max()) < TOLERANCE, key


@pytest.mark.parametrize("hold", [0, 1, 3])
def test_deferred_commits_give_every_row_once_with_its_immediate_tokens(
    engine: HunyuanLoopEngine, hold: int
) -> None:
    want, plain = run_all(engine, None)
    assert {k: len(d.tokens) for k, d in want.items()} == {
        f"img{60 + i}": cap for i, cap in enumerate(CAPS)}
    got, loop = run_all(engine, hold)
    same_rows(got, want)
    s = loop.stats
    assert s.prefilled_rows == len(CAPS)
    assert s.pending_iterations == hold * s.prefills  # each pass looked at `hold` times first
    assert s.late_passes == (s.prefills if hold else 0)
    if hold:
        assert s.overlap_steps > 0  # steps ran while a pass was pending
        assert s.steps > plain.stats.steps  # ... so rows joined later: more steps in all
    assert plain.stats.late_passes == plain.stats.pending_iterations == 0
    assert plain.stats.overlap_steps == 0


def test_rows_made_live_before_their_commit_are_caught(engine: HunyuanLoopEngine) -> None:
    """A row live before its commit is read as finished from its slot's stale flag: it comes
    back with the last row's count and none of its own logits (or, had it any, wrong ones)."""
    want, _ = run_all(engine, None)
    with pytest.raises((AssertionError, RuntimeError)):
        same_rows(run_all(engine, 3, EagerLoop)[0], want)


def launch_a_pending_pass(engine: HunyuanLoopEngine, hold: int
                          ) -> tuple[RunningLoop, list[str], dict[str, Any]]:
    """A deferred loop whose second pass is pending: the keys of its rows, and the rows handed
    back so far."""
    loop = make_loop(engine, batch(engine), hold)
    loop.add(batch(engine))
    handed: dict[str, Any] = {}
    while loop.stats.prefills < 2:
        handed.update((d.row.key, d) for d in loop.run(timeout_s=0))
    pending = loop.runner.passes.pending
    assert pending is not None and not loop.idle()
    keys = [r.key for r in pending.rows]
    assert keys and not any(k in {r.key for r in loop.rows.values()} for k in keys)
    assert not any(k in {r.key for r in loop.waiting} for k in keys)
    held = loop.runner.passes.slots()
    assert held <= {a.slot for a in loop.scheduler.running.values()}  # not offered again
    return loop, keys, handed


def test_dropping_a_row_of_a_pending_pass(engine: HunyuanLoopEngine) -> None:
    want, _ = run_all(engine, None)
    loop, keys, handed = launch_a_pending_pass(engine, hold=4)
    victim = keys[0]
    dropped = loop.drop({victim})
    assert [r.key for r in dropped] == [victim]
    assert victim not in {a for a in loop.scheduler.running}  # its slot and range free now
    handed.update((d.row.key, d) for d in loop.run(timeout_s=0))  # the next tick drops it
    assert loop.runner.passes.pending is None  # the pass was committed, its other rows live
    assert {k for k in keys if k != victim} <= {r.key for r in loop.rows.values()} | set(handed)
    assert victim not in {r.key for r in loop.rows.values()}
    got = drained(loop)
    assert victim not in got and not set(got) & set(handed)
    same_rows({**handed, **got}, {k: d for k, d in want.items() if k != victim})


def test_clearing_a_loop_with_a_pending_pass(engine: HunyuanLoopEngine) -> None:
    """Every row not handed back yet, live, pending or waiting, comes back from clear once."""
    loop, keys, handed = launch_a_pending_pass(engine, hold=4)
    live = {r.key for r in loop.rows.values()}
    cleared = [r.key for r in loop.clear()]
    assert len(cleared) == len(set(cleared))  # nothing twice
    assert set(keys) | live <= set(cleared)
    assert sorted([*cleared, *handed]) == sorted(f"img{60 + i}" for i in range(len(CAPS)))
    assert loop.idle() and loop.runner.passes.pending is None
    assert loop.pool == KvPool.empty(loop.config.pool_tokens)


def test_an_interactive_row_still_goes_in_the_next_pass(engine: HunyuanLoopEngine) -> None:
    """A loop full of bulk with one reserved slot: the interactive row is the whole next pass,
    ahead of the bulk rows queued before it, and decodes once that pass is committed."""
    bulk = [LoopRow(it.key, engine.preprocess(it), MAX_NEW, min_new_tokens=MAX_NEW)
            for it in (item(64, 64, 10 + i) for i in range(5))]
    fast = item(64, 64, 99)
    quick = LoopRow(fast.key, engine.preprocess(fast), 3, min_new_tokens=3, interactive=True)
    assert engine._decoder is not None and engine.tokens is not None
    config = engine.loop_config(RunningBudget(4, 8192, 4096, 0, 0, 0, 0, 1),
                                lanes=LanePolicy(reserved_slots=1), prefill_stream=True)
    loop = RunningLoop(engine._decoder, engine.tokens, config)
    loop.runner.passes.hold = 2
    loop.add(bulk)
    while loop.live < 3:
        loop.run(timeout_s=0)
    assert [r.key for r in loop.waiting] == ["img13", "img14"]
    loop.add([quick])
    while loop.runner.passes.pending is None:
        loop.run(timeout_s=0)
    assert [r.key for r in loop.runner.passes.pending.rows] == ["img99"]
    assert [r.key for r in loop.waiting] == ["img13", "img14"]  # bulk still waits its turn
    while loop.runner.passes.pending is not None:
        loop.run(timeout_s=0)
    assert "img99" in {r.key for r in loop.rows.values()} and loop.live == 4
    done = drained(loop)
    assert {k: len(d.tokens) for k, d in done.items()} == {
        **{f"img{10 + i}": MAX_NEW for i in range(5)}, "img99": 3}
    assert loop.stats.prefilled_interactive == 1 and loop.stats.late_passes > 0


def test_the_setting_reaches_the_loop(tmp_path_factory: pytest.TempPathFactory,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """OCRQ_PREFILL_STREAM (the benches pass it through the environment) -> LoopConfig."""
    from ocrq.core.settings import Settings

    assert Settings(_env_file=None).prefill_stream is False
    monkeypatch.setenv("OCRQ_PREFILL_STREAM", "true")
    path = tiny_checkpoint(tmp_path_factory.mktemp("setting"), "1.5")
    eng = HunyuanLoopEngine(cpu_settings(str(path), MAX_NEW), decode="fast")
    assert eng.settings.prefill_stream is True
    eng.load()
    config = eng.loop_config(RunningBudget(2, 1024, 4096, 0, 0, 0, 0))
    assert config.prefill_stream is True
