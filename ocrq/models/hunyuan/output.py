"""Turn HunyuanOCR's generated text into an OcrResult: lines with boxes, and loop trimming.

Pure string work, so it is tested without torch. Every box the model writes is normalised to
0..1000 of the image it saw (x by its width, y by its height); because the coordinates are
relative, they map to the ORIGINAL image by its own size, whatever resizing (prefetch cap,
resolution preset, planner) happened in between. The answer formats, by task
(ocrq/models/hunyuan/prompts.py, `ANSWER_KINDS`):

* `spotting` answers with items written `text(x1,y1),(x2,y2)`, one after another. Text may
  itself hold parentheses ("ATLANTA (AP)", "金额(小写)"), so an item ends only at a pair of
  integer coordinate pairs; extra pairs after the first two are dropped.
* `spotting_json` (1.5) answers with a JSON array of {"box": [x1, y1, x2, y2], "text": ...}
  (Tencent's scorer also takes "bbox"); an array cut short by the token cap keeps its whole
  elements.
* `layout` (1.5) answers with a JSON array of regions {"layout_type", "bbox", "text"?} whose
  bbox is a string or list of corner points, or in the older hy-meta form
  `text<hy-meta><layout>kind</layout><poly>(x,y),...</poly></hy-meta>`; each region becomes a
  line labelled with its kind, boxed by its corners' bounding rectangle.
* `parse` / `layout_parse` answer in markdown where figures and captions carry a trailing box
  (`caption(x1,y1),(x2,y2)`, or a bare `(x1,y1),(x2,y2)` line for a figure without text):
  those boxes become lines labelled "figure" and leave the markdown (Tencent's own post-processing
  strips them too), except inside tables and display math.
* Everything else is text.

Greedy decoding can loop ("abcabcabc..." until the token cap). `trim_repeated_tail` keeps one
copy of a unit repeated at the end of the text. It applies only to outputs that were cut (by the
token cap or the repetition guard): a loop never ends by itself, while legitimate repeats (dot
leaders in a table of contents) end in an eos.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ocrq.models.base import Line, OcrResult, PreparedImage
from ocrq.models.hunyuan.generation import Generated
from ocrq.models.hunyuan.prompts import PROMPTS_1_5, answer_kind

_COORD = r"\(\s*(\d+)\s*,\s*(\d+)\s*\)"
_BOX = re.compile(_COORD + r"\s*,\s*" + _COORD + r"(?:\s*,\s*\(\s*\d+\s*,\s*\d+\s*\))*")
NORMALISED = 1000  # the model's coordinate range
SPOTTING_SCORE = 1.0  # the model reports no confidence; every parsed line counts as found
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TRAILING_BOX = re.compile(r"^(?P<text>.*?)\s*" + _COORD + r"\s*,\s*" + _COORD + r"\s*$")
_HY_META = re.compile(
    r"(?P<text>[^<]*)<hy-meta>\s*<layout>(?P<kind>.*?)</layout>\s*"
    r"<(?:poly|quad)>(?P<points>.*?)</(?:poly|quad)>\s*</hy-meta>",
    re.S,
)


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


def box_of(value: Any) -> tuple[int, int, int, int] | None:
    """The bounding rectangle (0..1000) of a box however the model wrote it: [x1, y1, x2, y2],
    a list of [x, y] corners, or a string of "(x,y),(x,y),..." corners; None when unreadable."""
    if isinstance(value, str):
        numbers = [float(n) for n in _NUMBER.findall(value)]
    elif isinstance(value, list | tuple):
        flat: list[Any] = []
        for v in value:
            flat.extend(v if isinstance(v, list | tuple) else [v])
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
            return None
        numbers = [float(v) for v in flat]
    else:
        return None
    if len(numbers) < 4 or len(numbers) % 2:
        return None
    xs, ys = numbers[0::2], numbers[1::2]
    return round(min(xs)), round(min(ys)), round(max(xs)), round(max(ys))


def json_objects(output: str) -> list[dict[str, Any]]:
    """The JSON objects of an answer, in order: each `{...}` that decodes (an answer may be
    fenced in ```json, and one cut by the token cap ends in an unfinished object, skipped)."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    at = output.find("{")
    while at != -1:
        try:
            obj, end = decoder.raw_decode(output, at)
        except ValueError:
            at = output.find("{", at + 1)
            continue
        if isinstance(obj, dict):
            found.append(obj)
        at = output.find("{", end)
    return found


def parse_spotting_json(output: str) -> list[SpottedText]:
    """Items of a `spotting_json` answer: objects with a readable "box" (or "bbox") and text."""
    items = []
    for obj in json_objects(output):
        box = box_of(obj.get("box", obj.get("bbox")))
        text = obj.get("text")
        if box is not None and isinstance(text, str) and text.strip():
            items.append(SpottedText(text.strip(), box))
    return items


@dataclass(frozen=True)
class Region:
    """One layout region as the model wrote it: its kind, corners' rectangle and text."""

    kind: str
    box: tuple[int, int, int, int]
    text: str


def parse_layout(output: str) -> list[Region]:
    """Regions of a `layout` answer, JSON or hy-meta form (module docstring)."""
    regions = []
    for obj in json_objects(output):
        kind = obj.get("layout_type", obj.get("type", obj.get("category")))
        box = box_of(obj.get("bbox", obj.get("box", obj.get("poly"))))
        text = obj.get("text")
        if isinstance(kind, str) and box is not None:
            regions.append(Region(kind.strip(), box, text.strip() if isinstance(text, str) else ""))
    if regions:
        return regions
    for match in _HY_META.finditer(output):
        box = box_of(match["points"])
        if box is not None:
            regions.append(Region(match["kind"].strip(), box, match["text"].strip()))
    return regions


def split_figure_boxes(markdown: str) -> tuple[str, list[SpottedText]]:
    """A parsed page's markdown without the boxes that end figure and caption lines, and those
    boxes (with the caption, "" for a bare figure) in order. Lines inside HTML tables and
    display math keep what they hold."""
    kept: list[str] = []
    figures: list[SpottedText] = []
    in_math = False
    for line in markdown.split("\n"):
        stripped = line.strip()
        toggles = stripped.count("$$") % 2 == 1 or stripped in ("\\[", "\\]")
        protected = in_math or "<table" in stripped or "<td" in stripped or "<tr" in stripped
        match = None if protected else _TRAILING_BOX.match(line)
        if toggles:
            in_math = not in_math
        if match is None:
            kept.append(line)
            continue
        x1, y1, x2, y2 = (int(match.group(i)) for i in range(2, 6))
        caption = match["text"].strip()
        figures.append(SpottedText(caption, (x1, y1, x2, y2)))
        if caption:
            kept.append(match["text"].rstrip())
    return "\n".join(kept), figures


def build_result(
    output: str,
    *,
    task: str,
    original_size: tuple[int, int],
    truncated: str | None = None,
) -> OcrResult:
    """OcrResult for one generated answer, read as `task` (an answer kind).

    `truncated` says the generation was cut ("max_tokens" or "repetition") rather than ended by
    an eos: only then is a repeated tail a loop worth trimming, and the result carries it. For
    the boxed kinds, `text` is the recognised lines joined by newlines (the raw answer when
    nothing parses).
    """
    if truncated:
        output = trim_repeated_tail(output)

    def done(text: str, lines: list[Line] | None = None) -> OcrResult:
        return OcrResult(text=text, lines=lines or [], truncated=truncated)

    if task in ("spotting", "spotting_json"):
        parse = parse_spotting if task == "spotting" else parse_spotting_json
        items = parse(output)
        if items:
            lines = [Line(i.text, to_pixels(i.box, original_size), SPOTTING_SCORE) for i in items]
            return done("\n".join(line.text for line in lines), lines)
    elif task == "layout":
        regions = parse_layout(output)
        if regions:
            lines = [
                Line(r.text, to_pixels(r.box, original_size), SPOTTING_SCORE, label=r.kind)
                for r in regions
            ]
            return done("\n".join(r.text for r in regions if r.text), lines)
    elif task == "parse":
        markdown, figures = split_figure_boxes(output)
        lines = [
            Line(f.text, to_pixels(f.box, original_size), SPOTTING_SCORE, label="figure")
            for f in figures
        ]
        return done(markdown.strip(), lines)
    return done(output.strip())


def result_of(
    item: PreparedImage, gen: Generated, prompts: Mapping[str, str] = PROMPTS_1_5
) -> OcrResult | Exception:
    """The OcrResult of one generated row (its task read in the loaded version's `prompts`),
    or the exception parsing it raised (that item fails alone)."""
    try:
        kind = answer_kind(item, prompts)
        return build_result(
            gen.text, task=kind, original_size=item.original_size, truncated=gen.truncated
        )
    except Exception as exc:
        return exc
