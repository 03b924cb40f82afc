"""A bench's scripted lengths (ocrq/testing/scripted.py) through the decode hooks
(ocrq/models/hunyuan/hooks.py): a random-weight row ends where the bench said, as at eos; an
engine built as the service builds it has no hooks, and its loops run nothing for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ocrq.models.base import PreparedImage
from ocrq.models.costs import CostModel
from ocrq.models.hunyuan import HunyuanLoopEngine
from ocrq.models.hunyuan.checkpoint import RANDOM_MARK, is_random_checkpoint
from ocrq.models.hunyuan.hooks import ForcedEos
from ocrq.models.registry import create_engine
from ocrq.testing.scripted import ScriptedLengths, worker_env, write_table
from tests.tiny_hunyuan import cpu_settings, mixed, tiny_checkpoint

pytestmark = pytest.mark.hunyuan
MAX_NEW = 12
LENGTHS = (3, 7)  # scripted lengths (eos included) of the first two rows; both under MAX_NEW
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("scripted"), "1.5")


def _engine(path: Path, hooks: ScriptedLengths | None = None) -> HunyuanLoopEngine:
    engine = HunyuanLoopEngine(cpu_settings(str(path), MAX_NEW), hooks=hooks)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def unscripted(checkpoint: Path) -> tuple[list[PreparedImage], dict[str, Any]]:
    """Three rows whose own output runs to the cap (no eos of their own), and that output."""
    engine = _engine(checkpoint)
    rows: list[PreparedImage] = []
    out: dict[str, Any] = {}
    for seed in range(1, 40, 3):
        for it in mixed(seed):
            got = engine.generate([it]).items[0]
            if got.truncated == "max_tokens" and len(rows) < 3:
                rows.append(it)
                out[it.key] = got
    assert len(rows) == 3
    return rows, out


@pytest.fixture()
def table(
    checkpoint: Path, unscripted: tuple[list[PreparedImage], dict[str, Any]]
) -> Iterator[Path]:
    """The bench's table beside the checkpoint, for the first two rows."""
    rows, _ = unscripted
    path = write_table(checkpoint, {rows[0].key: LENGTHS[0], rows[1].key: LENGTHS[1]})
    try:
        yield path
    finally:
        path.unlink()


@pytest.fixture()
def scripted(checkpoint: Path, table: Path) -> HunyuanLoopEngine:
    return _engine(checkpoint, ScriptedLengths.for_checkpoint(checkpoint))


def _check(engine: HunyuanLoopEngine, results: dict[str, Any], unscripted: Any) -> None:
    rows, alone = unscripted
    for it, want in zip(rows[:2], LENGTHS, strict=True):
        got = results[it.key]
        assert got.truncated is None, got  # ended as at eos
        # Its text is what the model says unscripted, cut where the script put the eos.
        assert got.text == engine.processor.tokenizer.decode(
            alone[it.key].token_ids[: want - 1], skip_special_tokens=True
        ).strip()
    assert results[rows[2].key].truncated == "max_tokens"  # no script: the model's own length


def _run_loop(engine: HunyuanLoopEngine, rows: list[PreparedImage]) -> dict[str, Any]:
    per_token = engine.cost_model().per_cache_token_bytes
    engine.open(2**24, CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token))
    engine.submit(rows)
    got: dict[str, Any] = {}
    while len(got) < len(rows):
        for f in engine.poll(1.0):
            got[f.key] = f.resolve()
    return got


def test_static_loop_ends_rows_at_their_scripted_length(
    scripted: HunyuanLoopEngine, unscripted: Any
) -> None:
    assert is_random_checkpoint(Path(scripted.model_dir))
    rows, _ = unscripted
    out = scripted.generate(rows).items
    for row, want in zip(out[:2], LENGTHS, strict=True):
        assert len(row.token_ids) == want - 1  # the eos itself is not kept
    _check(scripted, {it.key: o for it, o in zip(rows, out, strict=True)}, unscripted)


def test_running_loop_ends_rows_at_their_scripted_length(
    scripted: HunyuanLoopEngine, unscripted: Any
) -> None:
    """The continuous scheduler honours the same hooks; a scripted row still reserves its full
    cap in the pool (the memory plan stays a real model's)."""
    rows, _ = unscripted
    got = _run_loop(scripted, rows)
    assert scripted.loop is not None and scripted.loop.runner.tensors.forced is not None
    scripted.reset()
    _check(scripted, got, unscripted)


def test_a_production_engine_has_no_hooks_and_runs_no_forced_eos(
    checkpoint: Path, table: Path, unscripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built as the worker builds it (the registry), beside a table even: no hooks, no forced-eos
    state in the running loop, and not one call into it from either loop."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the forced-eos path ran in a production engine")

    for name in ("admit", "first", "step"):
        monkeypatch.setattr(ForcedEos, name, refuse)
    engine = create_engine("hunyuan", cpu_settings(str(checkpoint), MAX_NEW,
                                                   scheduler="continuous"))
    assert isinstance(engine, HunyuanLoopEngine)
    engine.load()
    assert engine.hooks is None
    rows, alone = unscripted
    static = engine.generate(rows).items
    got = _run_loop(engine, rows)
    assert engine.loop is not None and engine.loop.runner.hooks is None
    assert engine.loop.runner.tensors.forced is None
    engine.reset()
    for it, out in zip(rows, static, strict=True):  # every row its own length: the cap
        assert out.truncated == got[it.key].truncated == "max_tokens"
        assert out.text == got[it.key].text == alone[it.key].text


def test_scripted_lengths_refuse_a_real_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    del config[RANDOM_MARK]
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(config))
    write_table(real, {"a": 2})
    with pytest.raises(ValueError, match="not a random-weight checkpoint"):
        ScriptedLengths.for_checkpoint(real)
    with pytest.raises(ValueError, match="not a random-weight checkpoint"):
        worker_env(real, tmp_path / "site", {})


def test_worker_env_installs_the_hooks_in_every_new_process(
    checkpoint: Path, tmp_path: Path
) -> None:
    """What a bench's worker (and its engine process) starts with: the hooks installed before
    any engine is built, from the table beside the checkpoint."""
    path = write_table(checkpoint, {"job-a": 5})
    try:
        base = {**os.environ, "PYTHONPATH": str(REPO)}
        env = worker_env(checkpoint, tmp_path / "site", base)
        probe = (
            "from ocrq.models.hunyuan.hooks import installed; h = installed(); "
            "print(type(h).__name__, h.eos_at('job-a'), h.eos_at('job-b'))"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.stdout.split() == ["ScriptedLengths", "4", "None"], out.stderr
        plain = subprocess.run(
            [sys.executable, "-c", "from ocrq.models.hunyuan.hooks import installed; "
             "print(installed())"],
            env=base, capture_output=True, text=True, timeout=120,
        )
        assert plain.stdout.split() == ["None"], plain.stderr
    finally:
        path.unlink()
