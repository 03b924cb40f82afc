"""The fused few-row decode step wired into the running loop (ocrq/models/hunyuan/step_choice.py,
the lab lever OCRQ_LOOP_FUSED_STEP_ROWS), on the CPU in Triton's interpreter (a subprocess: the
interpreter is chosen when triton is first imported).

The tiny HunyuanOCR 1.5 (float32) through the running loop with Triton attention, two slots and
three rows of distinct images and caps, so the third row takes the slot and the KV range the
first left (a stale row's keys past its prompt): with the lever on, every step's logits come
from the fused step, and each row's tokens must be the lever-off loop's and transformers'
`generate()`'s, and its per-step logits the lever-off loop's within float32's noise. Tokens
alone could not fail on a tiny random model (tests/test_running_loop.py says why); the logits
can: a fused step that reads each row's keys from one past its start (its first prompt token
lost) moves them by orders of magnitude more than the tolerance.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from tests.interpreter import interpret
from tests.tiny_hunyuan import tiny_checkpoint

pytestmark = pytest.mark.hunyuan

MAX_NEW = 6
TOLERANCE = 1e-3  # float32 on the CPU: the two steps differ by ~1e-5 (summation order)

CHECK = textwrap.dedent(
    """
    import sys
    import torch
    from ocrq.models.hunyuan import HunyuanLoopEngine, step_choice
    from ocrq.models.hunyuan.loop_types import LoopRow
    from ocrq.models.hunyuan.running import RunningLoop
    from ocrq.models.slots import RunningBudget
    from tests.tiny_hunyuan import cpu_settings, item

    MAX_NEW = int(sys.argv[2])
    engine = HunyuanLoopEngine(cpu_settings(sys.argv[1], MAX_NEW), decode="fast")
    engine.load()
    items = [item(64, 96, 21), item(96, 64, 22, task="spotting"), item(64, 64, 23)]
    caps = [3, MAX_NEW, 4]  # row 0 leaves early; row 2 takes its slot and range
    generated = {
        it.key: engine.generate([it], max_new_tokens=cap, decode="generate").items[0].token_ids
        for it, cap in zip(items, caps)
    }

    def run(rows, which=(0, 1, 2), **extra):
        config = engine.loop_config(RunningBudget(2, 1024, 4096, 0, 0, 0, 0), keep_logits=True,
                                    fused_step_rows=rows, **extra)
        loop = RunningLoop(engine._decoder, engine.tokens, config)
        assert loop.runner.use_triton
        loop.add([LoopRow(items[i].key, engine.preprocess(items[i]), caps[i]) for i in which])
        done = {d.row.key: d for d in loop.drain()}
        fused = loop.runner.fused_steps
        return done, sorted(fused.steps) if fused is not None else []

    off, off_buckets = run(0)
    on, on_buckets = run(8)
    print("buckets", len(off_buckets), *on_buckets)
    for it in items:
        a, b = on[it.key], off[it.key]
        print("row", int(engine.finish(a).token_ids == engine.finish(b).token_ids),
              int(engine.finish(a).token_ids == generated[it.key]), len(a.tokens),
              float((a.logits - b.logits).abs().max()), float(b.logits.abs().max()))
    print("slots", *(on[it.key].row.slot for it in items),
          *(on[it.key].row.start for it in items))

    # An fp8 pool (values transposed, read padded): the third row alone, on against off.
    key = items[2].key
    on8, fused8 = run(8, (2,), kv_dtype="fp8")
    off8, _ = run(0, (2,), kv_dtype="fp8")
    print("fp8", int(on8[key].tokens == off8[key].tokens), len(on8[key].tokens), *fused8,
          float((on8[key].logits - off8[key].logits).abs().max()))

    call = step_choice.FusedSteps.__call__

    def lost(self, k, tok, pos, col, start, end, keys, values):
        # each live row's first key out of its range (a slot holding only its new key as is)
        return call(self, k, tok, pos, col, start + (end - start > 1).int(), end, keys, values)

    step_choice.FusedSteps.__call__ = lost
    broken, _ = run(8, (0,))  # the first row alone: its tokens do not depend on the others
    key = items[0].key
    print("lost", float((broken[key].logits - off[key].logits).abs().max()))
    """
)


@pytest.fixture(scope="module")
def lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.5")
    return interpret(CHECK, str(path), str(MAX_NEW), OCRQ_DECODE_ATTENTION="triton")


def values(lines: list[str], name: str) -> list[list[float]]:
    return [[float(x) for x in ln.split()[1:]] for ln in lines if ln.startswith(name + " ")]


def test_the_fused_step_in_the_loop_makes_the_same_tokens(lines: list[str]) -> None:
    ((today, *fused),) = values(lines, "buckets")
    assert today == 0 and fused == [2]  # lever off: no fused step; on: bucket 2 took it
    rows = values(lines, "row")
    assert len(rows) == 3
    for same_as_off, same_as_generate, made, diff, scale in rows:
        assert same_as_off == 1 and same_as_generate == 1
        assert made >= 3  # several decode steps each
        assert diff < TOLERANCE and scale > 1.0, (diff, scale)
    ((*slots, start0, _, start2),) = values(lines, "slots")
    assert slots == [0, 1, 0] and start2 == start0  # the third row reused the first's slot


def test_the_fused_step_in_the_loop_on_an_fp8_pool(lines: list[str]) -> None:
    """The fp8 pool's values transposed and read padded, as the loop's Triton attention reads
    them: the lever on makes the lever off's tokens and logits."""
    ((same, made, bucket, diff),) = values(lines, "fp8")
    assert same == 1 and made >= 3 and bucket == 2
    assert diff < TOLERANCE, diff


def test_the_check_can_fail(lines: list[str]) -> None:
    ((diff,),) = values(lines, "lost")
    assert diff > 100 * TOLERANCE, diff


# -- which step serves the loop (no Triton needed) ----------------------------------------------


@pytest.fixture(scope="module")
def text():  # -> TextModel
    torch = pytest.importorskip("torch")
    from transformers import HunYuanVLForConditionalGeneration

    from ocrq.models.hunyuan.text import TextModel
    from ocrq.testing.tiny_hunyuan import TINY_1_5, build_config

    model = HunYuanVLForConditionalGeneration._from_config(
        build_config(TINY_1_5), dtype=torch.float32).eval()
    return TextModel(model)


def config(rows: int, **extra: object):  # -> LoopConfig
    from ocrq.models.hunyuan.loop_types import LoopConfig

    return LoopConfig(slots=16, pool_tokens=512, max_new_tokens=8, fused_step_rows=rows, **extra)


def test_the_lever_serves_buckets_up_to_its_rows(text) -> None:
    import torch

    from ocrq.models.hunyuan.step_choice import fused_steps

    def choose(rows: int, **extra: object):
        return fused_steps(text, config(rows, **extra), "cpu", use_triton=True,
                           kv_dtype=torch.float32, padded=False)

    assert choose(0) is None
    steps = choose(8)
    assert steps is not None and steps.serves(8) and not steps.serves(16)
    assert choose(16).serves(16)  # type: ignore[union-attr]


def test_the_lever_is_left_off_where_the_fused_step_does_not_fit(
    text, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from ocrq.models.hunyuan.step_choice import fused_steps

    caplog.set_level(logging.WARNING)
    assert fused_steps(text, config(8), "cpu", use_triton=False, kv_dtype=torch.float32,
                       padded=False) is None
    assert "OCRQ_LOOP_FUSED_STEP_ROWS=8 ignored" in caplog.text and "torch" in caplog.text
    fp8 = torch.float8_e4m3fn
    assert fused_steps(text, config(8, kv_dtype="fp8", fp8_products=True), "cpu",
                       use_triton=True, kv_dtype=fp8, padded=True) is None
    assert "OCRQ_KV_FP8_PRODUCTS" in caplog.text
    # widened fp8 products: the fused step's own fp8 attention serves
    assert fused_steps(text, config(8, kv_dtype="fp8"), "cpu", use_triton=True, kv_dtype=fp8,
                       padded=True) is not None


def test_the_lever_reaches_the_loops_config(tmp_path: Path) -> None:
    """OCRQ_LOOP_FUSED_STEP_ROWS goes from the engine's settings to `LoopConfig`, the runner's
    (the scheduler's half of the config does not hold it: it plans rows, not kernels)."""
    from ocrq.models.hunyuan import HunyuanLoopEngine
    from ocrq.models.hunyuan.running import scheduler_config
    from ocrq.models.slots import RunningBudget
    from tests.tiny_hunyuan import cpu_settings

    path = tiny_checkpoint(tmp_path, "1.5")
    engine = HunyuanLoopEngine(cpu_settings(str(path), 4, loop_fused_step_rows=8),
                               decode="fast")
    engine.load()
    loop_config = engine.loop_config(RunningBudget(4, 256, 4096, 0, 0, 0, 0))
    assert loop_config.fused_step_rows == 8
    assert not hasattr(scheduler_config(loop_config), "fused_step_rows")


@pytest.mark.parametrize("rows", [-1, 17])
def test_the_loop_config_refuses_rows_the_fused_step_cannot_serve(rows: int) -> None:
    with pytest.raises(ValueError, match="fused_step_rows must be 0 \\(off\\) to 16"):
        config(rows)
