"""Turn HunyuanOCR's generated text into an OcrResult: spotting boxes and loop trimming.

Pure string work, so it is tested without torch. Two jobs:

* Spotting ("检测并识别图片中的文字，将文本坐标格式化输出。") answers with items written
  `text(x1,y1),(x2,y2)`, one after another, the corners normalised to 0..1000 of the image the
  model saw. Text may itself hold parentheses ("ATLANTA (AP)", "金额(小写)"), so an item ends
  only at a pair of integer coordinate pairs; extra pairs after the first two are dropped.
  Because the coordinates are relative, they map to the ORIGINAL image by its own size, whatever
  resizing happened in between.
* Greedy decoding can loop ("abcabcabc..." until the token cap). `trim_repeated_tail` keeps one
  copy of a unit repeated at the end of the text. The engine applies it only to outputs that hit
  the max_new_tokens cap: a loop never ends by itself, while legitimate repeats (dot leaders in a
  table of contents) end in an eos.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.base import Line, OcrResult, PreparedImage
from models.hunyuan.generation import Generated
from models.hunyuan.prompts import answer_kind

_COORD = r"\(\s*(\d+)\s*,\s*(\d+)\s*\)"
_BOX = re.compile(_COORD + r"\s*,\s*" + _COORD + r"(?:\s*,\s*\(\s*\d+\s*,\s*\d+\s*\))*")
NORMALISED = 1000  # the model's coordinate range
SPOTTING_SCORE = 1.0  # the model reports no confidence; every parsed line counts as found


@dataclass(frozen=True)
class SpottedText:
    """One spotting item as the model wrote it: corners normalised to 0..1000."""

    text: str
    box: tuple[int, int, int, int]


def parse_spotting(output: str) -> list[SpottedText]:
    """Items of a spotting answer, in order; text without coordinates is ignored.

    An item's text is everything between the end of the previous item's coordinates and the
    start of its own, stripped of surrounding whitespace; an item with empty text is skipped and
    an unfinished last item (cut by the token cap) is dropped.
    """
    items: list[SpottedText] = []
    start = 0
    for match in _BOX.finditer(output):
        text = output[start : match.start()].strip()
        start = match.end()
        if text:
            x1, y1, x2, y2 = (int(g) for g in match.groups())
            items.append(SpottedText(text, (x1, y1, x2, y2)))
    return items


def to_pixels(
    box: tuple[int, int, int, int], original_size: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Map a 0..1000 box to [x1, y1, x2, y2] pixels of an image of `original_size` (w, h).

    Corners are ordered (x1 <= x2, y1 <= y2) and clamped to the image.
    """
    width, height = original_size
    x1, y1, x2, y2 = box

    def scale(v: int, size: int) -> int:
        return min(size, max(0, round(v * size / NORMALISED)))

    xs = sorted((scale(x1, width), scale(x2, width)))
    ys = sorted((scale(y1, height), scale(y2, height)))
    return xs[0], ys[0], xs[1], ys[1]


def spotting_lines(output: str, original_size: tuple[int, int]) -> list[Line]:
    """Lines with boxes in pixels of the original image."""
    return [
        Line(item.text, to_pixels(item.box, original_size), SPOTTING_SCORE)
        for item in parse_spotting(output)
    ]


def _periodic_suffix_start(text: str, unit: int) -> int:
    """Start of the longest suffix of `text` that repeats with period `unit`.

    The suffix may end in a partial copy of the unit (the token cap cuts anywhere).
    """
    n = len(text)
    j = n - unit
    # Whole units first (string slices compare in C), then character by character.
    while j - unit >= 0 and text[j - unit : j] == text[j : j + unit]:
        j -= unit
    while j > 0 and text[j - 1] == text[j - 1 + unit]:
        j -= 1
    return j


def trim_repeated_tail(text: str, *, min_repeats: int = 4, max_unit: int = 256) -> str:
    """Keep one copy of a unit that repeats at least `min_repeats` times at the end of `text`.

    Of all unit lengths up to `max_unit`, the one whose repetition covers the longest tail wins
    (ties go to the shorter unit, so "aaaa" is trimmed with unit "a", not "aa"). Text whose tail
    is not a loop comes back unchanged.
    """
    n = len(text)
    best_start, best_unit = n, 0
    for unit in range(1, min(max_unit, n // min_repeats) + 1):
        if best_unit and unit % best_unit == 0:
            continue  # a multiple of the period already found covers no more text
        start = _periodic_suffix_start(text, unit)
        if n - start >= min_repeats * unit and start < best_start:
            best_start, best_unit = start, unit
    if not best_unit:
        return text
    return text[: best_start + best_unit]


def build_result(
    output: str, *, task: str, original_size: tuple[int, int], capped: bool
) -> OcrResult:
    """OcrResult for one generated answer.

    `capped` says the generation stopped at max_new_tokens rather than at an eos: only then is a
    repeated tail a loop worth trimming. For spotting, `text` is the recognised lines joined by
    newlines (the raw answer when nothing parses).
    """
    if capped:
        output = trim_repeated_tail(output)
    if task == "spotting":
        lines = spotting_lines(output, original_size)
        if lines:
            return OcrResult(text="\n".join(line.text for line in lines), lines=lines)
    return OcrResult(text=output.strip())


def result_of(item: PreparedImage, gen: Generated) -> OcrResult | Exception:
    """The OcrResult of one generated row, or the exception parsing it raised (that item fails
    alone)."""
    try:
        kind = answer_kind(item)
        return build_result(
            gen.text, task=kind, original_size=item.original_size, capped=gen.capped
        )
    except Exception as exc:
        return exc
