"""Spaces between words: the recogniser seldom emits them, the blank columns of the crop do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

# A blank column run is a word space when at least SPACE_GAP_RATIO x the ink height and
# SPACE_GAP_OVER_MEDIAN x the crop's median blank run (see `word_gaps`). SROIE token F1: 0.57
# without spaces, 0.80 with these; 0.73-0.81 over ratios 0.2-0.35 x multiples 1.5-3 and 0.50-0.74
# without the median term; page CER unchanged. A multiple of 2 missed the space of "LINE 42" in
# Pillow's default font (letter gaps up to 7 px, that space 11 px at 40 px).
SPACE_GAP_RATIO = 0.3
SPACE_GAP_OVER_MEDIAN = 1.75
# Between two digits the blank is judged net of the digits' own side bearings. Figures are
# tabular (every digit as wide as "0"), so a narrow "1" stands in a wide blank: in Pillow's
# default font "11" leaves 11 px of blank at 40 px, as wide as the space of "7 4", and "114"
# came out as "1 14". A digit's ink is taken to fill DIGIT_CELL_RATIO x the ink height (0.68-0.75
# for the digits other than "1" in that font and in DejaVu Sans), or the crop's widest single
# glyph if narrower (condensed print); what a narrower neighbour leaves of that cell is bearing.
# SROIE: F1 0.8065 -> 0.8132, digit-space-digit in the text 58 -> 30 (18 in the truth). Known
# miss: the space before a number starting with "1" in a line with descenders, whose ink height
# sets a higher bar ("2026 114" read "2026114" once in the 680 characters of a 13340x124 line);
# judging digits against their own height fixed it but split more receipt numbers (F1 0.8126).
DIGIT_CELL_RATIO = 0.7
DIGITS = frozenset("0123456789")


def ink_mask(crop: np.ndarray) -> np.ndarray:
    """Ink pixels of a crop: the minority class after Otsu binarisation, so dark-on-light and
    light-on-dark text both work."""
    gray = cv2.cvtColor(crop, cv2.COLOR_BGR2GRAY) if crop.ndim == 3 else crop
    _, binary = cv2.threshold(gray, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    ink = binary == 0
    return ~ink if ink.mean() > 0.5 else ink


def is_wide_char(ch: str) -> bool:
    """CJK and other wide scripts, written without spaces between words."""
    return ord(ch) >= 0x2E80


@dataclass(frozen=True)
class Gap:
    """A blank column run wide enough to be a word space: centre x, width, and the part of the
    width that tabular digits on both sides would leave anyway (see DIGIT_CELL_RATIO)."""

    x: float
    width: int
    digit_bearing: float


@dataclass(frozen=True)
class WordGaps:
    """The candidate word spaces of one crop, and the width a space needs."""

    gaps: tuple[Gap, ...] = ()
    min_gap: float = float("inf")

    def join(self, chars: Sequence[str], xs: Sequence[float]) -> str:
        """The characters read at crop positions `xs`, with a space wherever a word gap lies
        between two of them; whitespace collapsed."""
        if not chars:
            return ""
        out = [chars[0]]
        for k in range(1, len(chars)):
            prev, ch = chars[k - 1], chars[k]
            spaced = prev == " " or ch == " " or is_wide_char(prev) or is_wide_char(ch)
            if not spaced and self.space_between(xs[k - 1], xs[k], prev in DIGITS and ch in DIGITS):
                out.append(" ")
            out.append(ch)
        return " ".join("".join(out).split())

    def space_between(self, left: float, right: float, digits: bool) -> bool:
        return any(
            left < g.x < right and (not digits or g.width - g.digit_bearing >= self.min_gap)
            for g in self.gaps
        )


def word_gaps(crop: np.ndarray, stretch: float = 1.0) -> WordGaps:
    """Blank column runs wide enough to be spaces between words.

    A run is a space when it is at least SPACE_GAP_RATIO x the height of the ink (the text's own
    size, whatever margin the crop has) and SPACE_GAP_OVER_MEDIAN x the crop's median blank run
    (the gap between letters, wide in the monospaced print of receipts). Blank runs before the
    first and after the last ink column are margins, not gaps. `stretch`: how much the crop was
    widened (`crops.widen`), so that widths are still judged against the text's true height.
    """
    ink = ink_mask(crop)
    cols = np.flatnonzero(ink.any(axis=0))
    rows = np.flatnonzero(ink.any(axis=1))
    if cols.size < 2:
        return WordGaps()
    blanks = np.diff(cols) - 1  # blank columns between consecutive inked columns
    breaks = np.flatnonzero(blanks > 0)  # run breaks[j] lies between ink segments j and j + 1
    if breaks.size == 0:
        return WordGaps()
    ink_height = (rows[-1] - rows[0] + 1) * stretch  # in the crop's horizontal pixels
    min_gap = max(
        SPACE_GAP_RATIO * ink_height, SPACE_GAP_OVER_MEDIAN * float(np.median(blanks[breaks]))
    )
    starts = np.concatenate(([cols[0]], cols[breaks + 1]))
    stops = np.concatenate((cols[breaks], [cols[-1]]))
    widths = stops - starts + 1  # inked column segments: a glyph, or glyphs that touch
    glyphs = widths[widths <= ink_height]
    cell = min(DIGIT_CELL_RATIO * ink_height, float(glyphs.max()) if glyphs.size else 0.0)
    gaps = []
    for j, i in enumerate(breaks):
        if blanks[i] >= min_gap:
            bearing = (max(0.0, cell - widths[j]) + max(0.0, cell - widths[j + 1])) / 2
            gaps.append(Gap(float(cols[i] + (blanks[i] + 1) / 2), int(blanks[i]), bearing))
    return WordGaps(tuple(gaps), min_gap)
