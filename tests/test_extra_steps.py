"""Interactive-only decode steps (OCRQ_INTERACTIVE_EXTRA_STEPS, ocrq/models/hunyuan/running.py),
on the CPU with the tiny HunyuanOCR model.

A decode step is valid for every row it covers and greedy decoding is per row, so with the
extra steps on every row's tokens are those of the loop without them, each row comes back once,
and the repetition guard stops a looping row at the same count; what changes is how many full
steps an interactive row takes, which the tests assert on (fewer), and the host's count of a
row's tokens, which the guard and the harvest read (wrong counts show as a guard that stops a
row at another length, or never, and as rows handed back late or twice).

The loop here has 12 slots: bulk rows take slots 2..11 (the reserve is 0..1), the interactive
rows the lowest, so the extra steps run over the first 8 slots: bulk rows in 2..7 get extra
tokens too, those above do not.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from ocrq.models.hunyuan import HunyuanLoopEngine
from ocrq.models.hunyuan.loop_types import LoopRow
from ocrq.models.hunyuan.runner import LoopRunner
from ocrq.models.hunyuan.running import RunningLoop
from ocrq.models.hunyuan.versions import RepetitionGuard
from ocrq.models.loop.lane_pass import LanePolicy
from ocrq.models.slots import RunningBudget
from tests.tiny_hunyuan import cpu_settings, item, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

MAX_NEW = 64
BULK, RESERVED, EXTRA = 10, 2, 3
# Small enough for a CPU test (as tests/test_hunyuan_decode.py's): a check every 8 tokens.
SMALL = RepetitionGuard(every=8, min_repeats=4, max_unit=8, min_span=16)
LOOP = (40, 41)  # a looping row's tokens after its trigger


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HunyuanLoopEngine:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.0")
    eng = HunyuanLoopEngine(
        cpu_settings(str(path), MAX_NEW, max_batch=BULK, interactive_slots=RESERVED),
        decode="fast",
    )
    eng.load()
    return eng


class LoopingLoop(LoopRunner):
    """Tests only: in decode steps, a row whose previous token is `trigger` or in LOOP emits
    LOOP's next token (a forward hook on lm_head, as ocrq/testing/tiny_hunyuan.py's ForcedLoop,
    but keyed on each row's own previous token, so a row loops whichever steps and slots it is
    in)."""

    trigger = -1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prev: Any = None
        self._handle = self.text.lm_head.register_forward_hook(self._hook)

    def _hook(self, _module: Any, _args: Any, out: Any) -> Any:
        import torch

        prev = self._prev
        if prev is None or out.dim() != 2 or out.shape[0] != prev.shape[0]:
            return out  # a prefill pass: the model's own first token
        a, b = LOOP
        nxt = torch.where(prev == a, b, a)
        on = (prev == self.trigger) | (prev == a) | (prev == b)
        bonus = torch.zeros_like(out).scatter(1, nxt[:, None], 1e4) * on[:, None].to(out.dtype)
        return out + bonus

    def step(self, k: int) -> None:
        self._prev = self.tensors.tok[:k].clone()
        try:
            super().step(k)
        finally:
            self._prev = None

    def close(self) -> None:
        self._handle.remove()


def rows(engine: HunyuanLoopEngine) -> list[LoopRow]:
    """14 rows, every fourth interactive: more than the loop's slots, so later rows are
    admitted mid-flight into freed slots."""
    out = []
    for i in range(14):
        it = item(64 + 8 * (i % 3), 64, 40 + i)
        out.append(LoopRow(it.key, engine.preprocess(it), MAX_NEW, interactive=i % 4 == 1))
    return out


def drain(engine: HunyuanLoopEngine, extra: int, trigger: int | None = None, hold: int = 0,
          shadow: bool = False, cls: type | None = None, min_bucket: int = 8) -> dict[str, Any]:
    """Every row through a loop with `extra` interactive-only steps: per key, each Done's
    (tokens, stopped), the full steps (`_step_no`) by when it was handed back, its lane and slot;
    and the loop's stats. `hold`: passes deferred (as on the side stream) and held pending for
    that many iterations; `shadow`: interactive-only steps while one is (`pass_steps`)."""
    assert engine._decoder is not None and engine.tokens is not None
    budget = RunningBudget(BULK + RESERVED, 16384, 4096, 0, 0, 0, 0, RESERVED)
    lanes = LanePolicy(reserved_slots=RESERVED, extra_steps=extra, pass_steps=shadow)
    config = engine.loop_config(budget, lanes=lanes, guard=SMALL, prefill_stream=hold > 0,
                                min_bucket=min_bucket)
    cls = cls or (LoopingLoop if trigger is not None else LoopRunner)
    loop = RunningLoop(engine._decoder, engine.tokens, config, runner=cls)
    loop.runner.passes.hold = hold
    if isinstance(loop.runner, LoopingLoop) and trigger is not None:
        loop.runner.trigger = trigger
    loop.add(rows(engine))
    done: dict[str, list[tuple[list[int], int]]] = {}
    when: dict[str, int] = {}
    lane: dict[str, bool] = {}
    slot: dict[str, int] = {}
    try:
        while not loop.idle():
            for d in loop.run():
                done.setdefault(d.row.key, []).append((d.tokens, d.stopped))
                when[d.row.key] = loop.runner.books.step_no
                lane[d.row.key], slot[d.row.key] = d.row.interactive, d.row.slot
    finally:
        if isinstance(loop.runner, LoopingLoop):
            loop.runner.close()
    assert loop.pool.free_tokens == 16384 and not loop.rows  # every range and slot given back
    return {"done": done, "when": when, "lane": lane, "slot": slot,
            "stats": loop.collect_stats(wait=True), "log": getattr(loop.runner, "log", None)}


@pytest.fixture(scope="module")
def plain(engine: HunyuanLoopEngine) -> dict[str, Any]:
    return drain(engine, 0)


def test_extra_steps_change_no_token_and_finish_interactive_rows_in_fewer_steps(
    engine: HunyuanLoopEngine, plain: dict[str, Any]
) -> None:
    extra = drain(engine, EXTRA)
    assert all(len(v) == 1 for v in extra["done"].values())  # each row handed back once
    assert extra["done"] == plain["done"] and len(plain["done"]) == 14
    # Slots differ (without extra steps rows take the lowest free slot whatever their lane),
    # tokens do not. With them: interactive rows under the extra steps' bucket, bulk above the
    # reserve, some of it under the bucket too.
    slot, lane = extra["slot"], [k for k, v in plain["lane"].items() if v]
    assert lane and all(slot[k] < 8 for k in lane)
    assert all(slot[k] >= RESERVED for k in slot if not plain["lane"][k])
    assert any(slot[k] < 8 for k in slot if not plain["lane"][k])
    assert slot != plain["slot"]
    for k in lane:  # up to 1 + EXTRA tokens per full step instead of one
        assert extra["when"][k] * 2 < plain["when"][k], (k, extra["when"][k], plain["when"][k])
    s0, s = plain["stats"], extra["stats"]
    assert s0.extra_steps == 0 and s.extra_steps > 0
    assert s.steps - s.extra_steps < s0.steps  # fewer full steps (the bulk rows under 8 too)
    assert s.lane_steps > s.extra_steps and s.extra_decode_s > 0
    assert s.extra_decode_s < s.lane_decode_s <= s.decode_s
    assert s.slot_steps - s0.slot_steps <= 8 * s.extra_steps  # the extra steps' bucket


class BucketRunner(LoopRunner):
    """Today's runner, noting the slot count of every decode step by kind."""

    seen: ClassVar[dict[str, set[int]]] = {}

    def _launch_step(self, k: int, span: str) -> None:
        BucketRunner.seen.setdefault(span, set()).add(k)
        super()._launch_step(k, span)


@pytest.mark.parametrize("smallest", [1, 2, 8])
def test_a_smaller_bucket_changes_no_token_and_narrows_the_extra_steps(
    engine: HunyuanLoopEngine, plain: dict[str, Any], smallest: int
) -> None:
    """OCRQ_LOOP_MIN_BUCKET: with interactive rows in the reserve's 2 lowest slots, the
    interactive-only steps run over the smallest bucket holding them (1 or 2 slots, not 8), and
    every row's tokens are those of the loop without extra steps."""
    BucketRunner.seen = {}
    got = drain(engine, EXTRA, cls=BucketRunner, min_bucket=smallest)
    assert got["done"] == plain["done"]
    extra = BucketRunner.seen["decode_extra"]
    assert max(extra) == max(smallest, RESERVED) and min(extra) >= smallest
    assert min(k for ks in BucketRunner.seen.values() for k in ks) >= smallest


def test_the_smallest_bucket_is_a_bucket(engine: HunyuanLoopEngine,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ocrq.core.settings import Settings
    from ocrq.models.hunyuan.loop_types import LoopConfig
    from ocrq.models.hunyuan.warm_up import buckets

    assert Settings().loop_min_bucket == 8
    monkeypatch.setenv("OCRQ_LOOP_MIN_BUCKET", "3")
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        Settings()
    monkeypatch.setenv("OCRQ_LOOP_MIN_BUCKET", "2")
    assert Settings().loop_min_bucket == 2
    with pytest.raises(ValueError, match="min_bucket"):
        LoopConfig(slots=20, pool_tokens=2048, max_new_tokens=8, min_bucket=16)
    monkeypatch.setattr(engine, "settings",
                        engine.settings.model_copy(update={"loop_min_bucket": 2}))
    budget = RunningBudget(20, 2048, 4096, 0, 0, 0, 0)
    config = engine.loop_config(budget)
    assert config.min_bucket == 2
    # the warm-up captures every bucket the loop can step over: from the smallest up
    loop = RunningLoop(engine._decoder, engine.tokens, config)
    assert buckets(loop) == [2, 4, 8, 16, 20]


def test_the_guard_stops_a_looping_row_at_the_same_count(
    engine: HunyuanLoopEngine, plain: dict[str, Any]
) -> None:
    """A row that emits `trigger` then loops on two tokens: the guard stops it at the same
    token count with or without the extra steps, and the rows that never emit it are not
    stopped."""
    lane = sorted(k for k, v in plain["lane"].items() if v)
    tokens = plain["done"][lane[0]][0][0]
    trigger = tokens[6]
    assert trigger not in LOOP
    looped = drain(engine, 0, trigger)
    extra = drain(engine, EXTRA, trigger)
    assert all(len(v) == 1 for v in extra["done"].values())
    assert extra["done"] == looped["done"]
    stopped = {k: v[0][1] for k, v in looped["done"].items()}
    assert stopped[lane[0]] and stopped[lane[0]] % SMALL.every == 0
    assert looped["done"][lane[0]][0][0][7:9] in ([40, 41], [41, 40])
    for k, v in plain["done"].items():
        if not {trigger, *LOOP} & set(v[0][0][:-1]):
            assert stopped[k] == 0 and looped["done"][k] == v
    # Rows of both lanes were stopped, some of them while extra steps covered them.
    assert any(stopped[k] for k in lane)
    assert extra["stats"].extra_steps > 0
    for k in lane:
        if stopped[k]:
            assert extra["when"][k] < looped["when"][k]


class RecordingLoop(LoopRunner):
    """Tests only: the slot count of every interactive-only step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra_k: list[int] = []

    def _launch_step(self, k: int, span: str) -> None:
        if span == "decode_extra":
            self.extra_k.append(k)
        super()._launch_step(k, span)


def test_extra_steps_cover_only_the_reserve_when_interactive_rows_overflow_it(
    engine: HunyuanLoopEngine,
) -> None:
    """More interactive rows live than the reserve holds (12 at once, 2 reserved): those above
    it sit among the slots a full step covers, and the extra steps keep to the reserve's bucket
    instead of becoming full steps (on the H200 such steps cost 8-13 ms against 2.2,
    bench/results/lanes/lanes_h200_extra2_relaxed.md). Every row still ends, once, with the
    tokens of the loop without extra steps."""
    assert engine._decoder is not None and engine.tokens is not None
    out: dict[int, dict[str, list[int]]] = {}
    loops: dict[int, RecordingLoop] = {}
    for extra in (0, EXTRA):
        budget = RunningBudget(BULK + RESERVED, 16384, 4096, 0, 0, 0, 0, RESERVED)
        config = engine.loop_config(
            budget, lanes=LanePolicy(reserved_slots=RESERVED, extra_steps=extra), guard=SMALL
        )
        loop = RunningLoop(engine._decoder, engine.tokens, config, runner=RecordingLoop)
        loops[extra] = runner = loop.runner
        assert isinstance(runner, RecordingLoop)
        loop.add([
            LoopRow(it.key, engine.preprocess(it), MAX_NEW, interactive=True)
            for it in (item(64 + 8 * (i % 3), 64, 80 + i) for i in range(BULK + RESERVED))
        ])
        done: dict[str, list[int]] = {}
        slots: set[int] = set()
        while not loop.idle():
            for d in loop.run():
                assert d.row.key not in done
                done[d.row.key] = d.tokens
                slots.add(d.row.slot)
        out[extra] = done
        assert len(done) == BULK + RESERVED and loop.pool.free_tokens == 16384
        if extra:
            assert max(slots) >= 8  # rows above the reserve's bucket were live
    assert out[EXTRA] == out[0]
    assert loops[0].extra_k == []
    assert loops[EXTRA].extra_k and set(loops[EXTRA].extra_k) == {8}, loops[EXTRA].extra_k


class ShadowLoop(LoopRunner):
    """Tests only: every step's kind, and whether a pass was pending and a reserve row live.
    Every pass seen is kept alive so that its `id` is never reused by a later pass (an id
    reused made two passes read as one, a flaky failure in CI)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int | None, bool]] = []
        self.passes_seen: dict[int, object] = {}

    def _launch_step(self, k: int, span: str) -> None:
        pending = self.passes.pending
        if pending is not None:
            self.passes_seen.setdefault(id(pending), pending)
        self.log.append((span, None if pending is None else id(pending),
                         bool(self._reserve_lane())))
        super()._launch_step(k, span)


def trickle(engine: HunyuanLoopEngine, shadow: bool) -> dict[str, Any]:
    """The 14 rows fed one every other loop iteration (one iteration a `run(timeout_s=0)`), so
    passes of a row or two come while interactive rows are live; each pass held pending 3
    iterations (the side stream's deferral)."""
    budget = RunningBudget(BULK + RESERVED, 16384, 4096, 0, 0, 0, 0, RESERVED)
    lanes = LanePolicy(reserved_slots=RESERVED, extra_steps=EXTRA, pass_steps=shadow)
    config = engine.loop_config(budget, lanes=lanes, guard=SMALL, prefill_stream=True,
                                prefill_gap=1)
    loop = RunningLoop(engine._decoder, engine.tokens, config, runner=ShadowLoop)
    loop.runner.passes.hold = 3
    todo = rows(engine)
    done: dict[str, list[list[int]]] = {}
    tick = 0
    while todo or not loop.idle():
        if todo and tick % 2 == 0:
            loop.add([todo.pop(0)])
        tick += 1
        for d in loop.run(timeout_s=0):
            done.setdefault(d.row.key, []).append(d.tokens)
    assert loop.pool.free_tokens == 16384 and not loop.rows
    assert isinstance(loop.runner, ShadowLoop)
    return {"done": done, "log": loop.runner.log, "stats": loop.collect_stats(wait=True)}


def test_interactive_rows_decode_in_a_pending_passs_shadow(
    engine: HunyuanLoopEngine, plain: dict[str, Any]
) -> None:
    """OCRQ_INTERACTIVE_PASS_STEPS: while a pass is pending and a reserve row is live, the loop
    runs interactive-only steps, with one full step beside each pass. Every token is the
    plain loop's and each row comes back once. (That this is faster is a GPU's question: a
    small step overlaps the pass there; bench/results/lanes/README.md.)"""
    held, shadow = trickle(engine, False), trickle(engine, True)
    for run in (held, shadow):
        assert run["done"] == {k: [t for t, _ in v] for k, v in plain["done"].items()}
    s, h = shadow["stats"], held["stats"]
    assert h.pass_steps == 0 and 0 < s.pass_steps <= s.extra_steps
    assert s.pending_iterations > 0 and s.prefills > 4
    # Per pass pending while a reserve row was live: one full step at most beside it; without
    # the setting, more.
    def beside(log: list[tuple[str, int | None, bool]]) -> tuple[dict[int, int], int]:
        full: dict[int, int] = {}
        small = 0
        for span, pending, live in log:
            if pending is not None and live:
                if span == "decode_extra":
                    small += 1
                else:
                    full[pending] = full.get(pending, 0) + 1
        return full, small

    full, small = beside(shadow["log"])
    assert small and all(n <= 1 for n in full.values()), full
    held_full, _ = beside(held["log"])
    assert max(held_full.values()) > 1


def test_the_pass_steps_setting_reaches_the_loop(
    engine: HunyuanLoopEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ocrq.core.settings import Settings

    assert Settings().interactive_pass_steps is False
    monkeypatch.setenv("OCRQ_INTERACTIVE_PASS_STEPS", "true")
    assert Settings().interactive_pass_steps is True
    monkeypatch.setattr(engine, "settings",
                        engine.settings.model_copy(update={"interactive_pass_steps": True}))
    budget = RunningBudget(BULK + RESERVED, 16384, 4096, 0, 0, 0, 0, RESERVED)
    assert engine.loop_config(budget).lanes.pass_steps is True
