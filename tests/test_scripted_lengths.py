"""Bench-only scripted lengths: a random-weight row ends where the bench said, as at eos, and
nothing but a random-weight checkpoint reads the table (ocrq/models/hunyuan/scripted.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ocrq.models.base import PreparedImage
from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.scripted import RANDOM_MARK, TABLE_NAME, is_random_checkpoint, write_table
from tests.tiny_hunyuan import cpu_settings, mixed, tiny_checkpoint

pytestmark = pytest.mark.hunyuan
MAX_NEW = 12
LENGTHS = (3, 7)  # scripted lengths (eos included) of the first two rows; both under MAX_NEW


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("scripted"), "1.5")


def _engine(path: Path) -> HunyuanEngine:
    engine = HunyuanEngine.from_settings(cpu_settings(str(path), MAX_NEW))
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
def scripted(
    checkpoint: Path, unscripted: tuple[list[PreparedImage], dict[str, Any]]
) -> Iterator[HunyuanEngine]:
    rows, _ = unscripted
    write_table(checkpoint, {rows[0].key: LENGTHS[0], rows[1].key: LENGTHS[1]})
    try:
        yield _engine(checkpoint)
    finally:
        (checkpoint / TABLE_NAME).unlink()


def _check(engine: HunyuanEngine, results: dict[str, Any], unscripted: Any) -> None:
    rows, alone = unscripted
    for it, want in zip(rows[:2], LENGTHS, strict=True):
        got = results[it.key]
        assert got.truncated is None, got  # ended as at eos
        # Its text is what the model says unscripted, cut where the script put the eos.
        assert got.text == engine.processor.tokenizer.decode(
            alone[it.key].token_ids[: want - 1], skip_special_tokens=True
        ).strip()
    assert results[rows[2].key].truncated == "max_tokens"  # no script: the model's own length


def test_static_loop_ends_rows_at_their_scripted_length(
    scripted: HunyuanEngine, unscripted: Any
) -> None:
    assert is_random_checkpoint(Path(scripted.model_dir))
    rows, _ = unscripted
    out = scripted.generate(rows).items
    for row, want in zip(out[:2], LENGTHS, strict=True):
        assert len(row.token_ids) == want - 1  # the eos itself is not kept
    _check(scripted, {it.key: o for it, o in zip(rows, out, strict=True)}, unscripted)


def test_running_loop_ends_rows_at_their_scripted_length(
    scripted: HunyuanEngine, unscripted: Any
) -> None:
    """The continuous scheduler honours the same table; a scripted row still reserves its full
    cap in the pool (the memory plan stays a real model's)."""
    from ocrq.models.costs import CostModel

    rows, _ = unscripted
    per_token = scripted.cost_model().per_cache_token_bytes
    scripted.open(2**24, CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token))
    scripted.submit(rows)
    got: dict[str, Any] = {}
    while len(got) < 3:
        for f in scripted.poll(1.0):
            got[f.key] = f.resolve()
    scripted.reset()
    _check(scripted, got, unscripted)


def test_a_real_checkpoint_ignores_the_table(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    del config[RANDOM_MARK]
    real = tmp_path / "real"
    real.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "config.json":
            (real / f.name).symlink_to(f)
    (real / "config.json").write_text(json.dumps(config))
    batch = mixed(7)[:1]
    write_table(real, {batch[0].key: 2})
    engine = _engine(real)
    assert engine.scripted == {}
