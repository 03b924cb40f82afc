"""Long lines read in tiles, so the recogniser's input never outgrows REC_TILE_COLUMNS.

The recogniser's memory and time grow with its input's width (48 x width / height columns for a
crop), with no bound of its own: a 1x100000 image read as one line asked for 4.8 million columns
and 22 GB. A crop wider than one tile is cut into tiles that overlap by TILE_OVERLAP crop heights
on each side of each cut; each tile is read alone at the recogniser's height, and each character
is taken from the one tile whose own stretch holds its position. Cuts go where the column has
the least ink, a blank between letters or words when there is one, so the character nearest a
cut sits well inside both tiles and both read it whole; the overlap is context, not text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ocrq.models.rapid.crops import REC_HEIGHT, REC_WIDTH_STEP
from ocrq.models.rapid.spacing import ink_mask

# Widest recogniser input (a multiple of REC_WIDTH_STEP): 240 output steps, 100+ characters.
# One 48 x 1920 input costs 40 MiB and 0.2-0.4 s on the 2-core CI VM; a call holds
# REC_MAX_CALL_COLUMNS / 1920 = 8 of them.
REC_TILE_COLUMNS = 1920
TILE_OVERLAP = 1.0
# A line needing more columns than this is refused, not read: 34 tiles, 10 s or more of CPU for
# one line (a 5000-character line at normal proportions). A 1x3000 image read as one line needs
# 144,000; a 13340x124 text line of 680 characters about 16,000 once detected.
REC_MAX_LINE_COLUMNS = 65_536

assert REC_TILE_COLUMNS % REC_WIDTH_STEP == 0


class LineTooLong(ValueError):
    """A region so long for its height that reading it is not worth its cost."""


def line_columns(width: int, height: int) -> int:
    """Recogniser columns a width x height crop needs when read at REC_HEIGHT."""
    return math.ceil(REC_HEIGHT * width / max(height, 1))


def check_line(width: int, height: int, what: str) -> None:
    """Refuse a region that would need more than REC_MAX_LINE_COLUMNS recogniser columns."""
    columns = line_columns(width, height)
    if columns > REC_MAX_LINE_COLUMNS:
        raise LineTooLong(
            f"{what} of {width}x{height} px read as one text line would need {columns} "
            f"recogniser columns, over this engine's limit of {REC_MAX_LINE_COLUMNS}: "
            "too long and thin to read"
        )


@dataclass(frozen=True)
class Tile:
    """Columns [start, stop) of a crop go to the recogniser; characters read at crop x in
    [keep_from, keep_to) are this tile's."""

    start: int
    stop: int
    keep_from: float = -math.inf
    keep_to: float = math.inf


def tiles(crop: np.ndarray, max_columns: int = REC_TILE_COLUMNS) -> list[Tile]:
    """How to read `crop`: one tile when it fits `max_columns`, else overlapping tiles."""
    h, w = crop.shape[:2]
    span = max(4, math.floor(max_columns * h / REC_HEIGHT))  # crop columns in one tile
    if w <= span:
        return [Tile(0, w)]
    overlap = max(1, min(round(TILE_OVERLAP * h), span // 4))
    ink = ink_mask(crop).sum(axis=0)
    out: list[Tile] = []
    start, keep_from = 0, -math.inf
    while w - start > span:
        cut = _quietest(ink, start + span // 2, start + span - overlap)
        out.append(Tile(start, cut + overlap, keep_from, cut))
        start, keep_from = cut - overlap, cut
    out.append(Tile(start, w, keep_from))
    return out


def _quietest(ink: np.ndarray, lo: int, hi: int) -> int:
    """The column in [lo, hi] to cut at: least ink, in the middle of the longest such run (the
    rightmost on a tie, for longer tiles)."""
    window = ink[lo : hi + 1]
    quiet = np.flatnonzero(window == window.min())
    runs = np.split(quiet, np.flatnonzero(np.diff(quiet) > 1) + 1)
    best = max(reversed(runs), key=len)
    return lo + int(best[len(best) // 2])


@dataclass
class Reading:
    """What the recogniser emitted for a crop or a tile: characters, their x in its pixels, and
    the probability of each."""

    chars: list[str] = field(default_factory=list)
    xs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    probs: np.ndarray = field(default_factory=lambda: np.zeros(0))


def stitch(parts: list[tuple[Tile, Reading]]) -> Reading:
    """One reading for a crop from its tiles' readings: each keeps the characters of its own
    stretch, positions moved into the crop's pixels."""
    chars: list[str] = []
    xs: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    for tile, reading in parts:
        at = reading.xs + tile.start
        keep = (at >= tile.keep_from) & (at < tile.keep_to)
        chars += [c for c, k in zip(reading.chars, keep, strict=True) if k]
        xs.append(at[keep])
        probs.append(reading.probs[keep])
    if not chars:
        return Reading()
    return Reading(chars, np.concatenate(xs), np.concatenate(probs))
