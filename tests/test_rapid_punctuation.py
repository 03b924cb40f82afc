"""Chinese punctuation in Latin text folded to ASCII by the CPU engine
(ocrq/models/rapid/punctuation.py), on by default and off by OCRQ_RAPID_LATIN_PUNCTUATION; the
SROIE receipts' whole texts are checked in test_rapid_engine's accuracy test."""

from __future__ import annotations

import pytest
from PIL import Image

from ocrq.core.settings import Settings
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.rapid import RapidEngine
from ocrq.models.rapid.punctuation import FOLD, fold_latin
from ocrq.models.registry import create_engine
from tests.test_rapid_engine import eval_data


@pytest.mark.parametrize(
    "read, folded",
    [
        # What the recogniser made of the SROIE receipts (tests/rapid_detected_boxes.json).
        ("MR. D.I.Y.（KUCHAI) SDN BHD", "MR. D.I.Y.(KUCHAI) SDN BHD"),
        ("（GST ID No : 001656262656）", "(GST ID No : 001656262656)"),
        ("L0T 1851 A & 1851-B, JALAN KPB 6，", "L0T 1851 A & 1851-B, JALAN KPB 6,"),
        ("：05-05- 2018 11 :25:29", ":05-05- 2018 11 :25:29"),
        ('1/2" PVC BIB TAP？?', '1/2" PVC BIB TAP??'),
        ("*一", "*-"),
        ("theme一children", "theme-children"),
        ("《rapide》 saute", "«rapide» saute"),  # eurotext's French guillemets
        ("Total（RM）：12.00\n合计：12.00", "Total(RM):12.00\n合计：12.00"),  # line by line
    ],
)
def test_latin_text_gets_ascii_punctuation(read: str, folded: str) -> None:
    assert fold_latin(read) == folded


@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！",  # Chinese keeps its full-width forms
        "价格：RM12（含税）",  # a colon and brackets next to Chinese
        "一个iPhone",  # 一 the numeral, before a Chinese word
        "一",  # alone: nothing says it is a dash
        "第一章：Python入门",
        "m² ½ ﬁ ™",  # what NFKC would rewrite and a Latin reader keeps
    ],
)
def test_cjk_text_and_other_symbols_are_kept(text: str) -> None:
    assert fold_latin(text) == text


def test_the_setting_is_on_when_empty_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OCRQ_RAPID_LATIN_PUNCTUATION", "")
    assert Settings().rapid_latin_punctuation is True
    assert create_engine("rapid", Settings()).latin_punctuation is True  # type: ignore[attr-defined]
    monkeypatch.setenv("OCRQ_RAPID_LATIN_PUNCTUATION", "false")
    assert create_engine("rapid", Settings()).latin_punctuation is False  # type: ignore[attr-defined]


def test_the_engine_folds_a_real_receipt_unless_told_not_to() -> None:
    """The head of SROIE receipt 086, where PP-OCRv4's recogniser reads two of its brackets as
    "（" (v6, the default, reads them as ASCII here)."""
    path = eval_data() / "sroie" / "img" / "086.jpg"
    with Image.open(path) as raw:
        head = raw.convert("RGB").crop((150, 330, 800, 610))
    item = PreparedImage("086-head", head, head.size)
    texts = {}
    for on in (True, False):
        engine = RapidEngine(latin_punctuation=on, models="v4")
        engine.load()
        result = engine.run([item])[0]
        assert isinstance(result, OcrResult), result
        texts[on] = result.text
    assert "（" in texts[False] and "(GST ID" in texts[True]
    assert not set(texts[True]) & set(FOLD)
    assert texts[True] == fold_latin(texts[False])
