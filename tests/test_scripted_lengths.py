"""Bench-only scripted lengths: a random-weight row ends where the bench said, as at eos, and
nothing but a random-weight checkpoint reads the table (ocrq/models/hunyuan/scripted.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.scripted import RANDOM_MARK, is_random_checkpoint, write_table
from tests.tiny_hunyuan import cpu_settings, mixed, tiny_checkpoint

pytestmark = pytest.mark.hunyuan
MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("scripted"), "1.5")


def _engine(path: Path) -> HunyuanEngine:
    engine = HunyuanEngine.from_settings(cpu_settings(str(path), MAX_NEW))
    engine.load()
    return engine


def test_rows_end_at_their_scripted_length_as_at_eos(checkpoint: Path) -> None:
    assert is_random_checkpoint(checkpoint)
    batch = mixed(7)[:3]
    scripted = {batch[0].key: 3, batch[1].key: 7}  # the third row keeps the model's choice
    write_table(checkpoint, scripted)
    try:
        engine = _engine(checkpoint)
        out = engine.generate(batch).items
    finally:
        (checkpoint / "ocrq_scripted_lengths.json").unlink()
    for row, want in zip(out[:2], [3, 7], strict=True):
        assert len(row.token_ids) == want - 1  # the eos itself is not kept
        assert row.truncated is None  # ended as at eos: not truncated
    assert out[2].truncated == "max_tokens" and len(out[2].token_ids) == MAX_NEW


def test_a_real_checkpoint_ignores_the_table(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    del config[RANDOM_MARK]
    real = tmp_path / "real"
    real.mkdir()
    for f in checkpoint.iterdir():
        (real / f.name).symlink_to(f)
    (real / "config.json").unlink()
    (real / "config.json").write_text(json.dumps(config))
    batch = mixed(7)[:1]
    write_table(real, {batch[0].key: 2})
    engine = _engine(real)
    assert engine.scripted == {}
    assert len(engine.generate(batch).items[0].token_ids) == MAX_NEW
