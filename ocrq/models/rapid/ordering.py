"""Reading order: the page cut into blocks (columns, then the blocks of each column), each
block's boxes grouped into rows, close neighbours on a row merged into one line.

Blocks come from a recursive XY-cut over the detected boxes: a region is cut across at every
horizontal gap clear of boxes that is BLOCK_GAP line heights taller than the page's usual gap
between rows; failing that, down at every vertical gap clear of boxes when each side looks like
a column of text (COLUMN_MIN_ROWS rows, COLUMN_MIN_WIDTH line heights wide); failing both, it is
one block, read row by row; unless a gutter that a few boxes cross parts two columns of set text
(`_cut_crossed`: PP-OCRv6 joins the level first lines of two columns into one box), where such
a box is cut at the gutter before it is read (`gutter_cuts`). Sorting the whole page into rows,
as before, read a 3-column page across its columns, line 1 of each column, then line 2
(character error rate of the whole page 0.74, 0.03 now; v6's 0.736 before the gutter cuts,
0.026 with them). Where a region is cut across, a short block standing at the foot of a column
right over the part below, a block gap under its column's text and nearer what follows, goes
with the part below (`_decks_down`: a heading's deck set under one column, which was read after
that column: the page's whole CER 0.0264, 0.0053 with it, the zoned CER). The column test is
what keeps a receipt read row by row: its prices stand apart from the items in a narrow column
of their own (on the 20 SROIE receipts the narrower side of every gap down was at most 7.4 line
heights wide, or 2 rows deep), where a page's columns are 12 line heights wide and 13 rows or
more deep. bench/results/reading_order/ has
the figures; a layout model was not tried: this needs no model and takes milliseconds a page.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from statistics import median

Box = tuple[float, float, float, float]
Piece = tuple[str, Box, float]

# A gap across a region this many line heights taller than the page's usual gap between rows
# separates two blocks. On the eval page the rows of a column overlap (the detector grows its
# boxes) and the title stands 0.69-0.78 line heights apart; a receipt's rows are 0.1-0.5 apart
# and its sections 0.8-4.6. Lines drawn evenly 1.6 font sizes apart (0.77) stay one block.
BLOCK_GAP = 0.5
# A vertical gap this wide (line heights) may part two columns; the eval page's gutters are
# 0.35-0.4. A word space is about as wide, but one running down every row of a region is a
# gutter, or the gap in a table, which the column test catches.
COLUMN_GAP = 0.2
COLUMN_MIN_ROWS = 3
COLUMN_MIN_WIDTH = 8.0  # line heights: about 20 characters
# A gutter may be crossed by a few boxes, up to CROSSERS_PER_ROW x the region's rows (at least
# MIN_CROSSERS): PP-OCRv6's detector joins the first lines of two columns that stand level across
# a narrow gutter into one box (8071_093.3B: 3 such boxes, at any detector scale from 1600 to
# 3312 px and any threshold or unclip ratio tried), which closed every gutter to the strict cut
# and read the page across its columns (whole CER 0.736). A crosser of about a line's height is
# two lines: `gutter_cuts` cuts it at the gutter before it is read. One HEADING_HEIGHT line
# heights tall or more is a heading spanning the columns: the region is cut across at its top.
CROSSERS_PER_ROW = 0.1
MIN_CROSSERS = 2
HEADING_HEIGHT = 1.8
# ... and the narrower side's lines must fill it (its median box LINE_FILL of its width or more),
# as a column of set text does: a receipt's column of short prices, beside item lines, passed
# the column test once two long item names were taken for crossers (SROIE 086).
LINE_FILL = 0.6
# Gutters that boxes cross are looked for between the boxes less INSET x their height on the
# left and right: the detector grows each box by a margin, and v6's margins (at the unclip ratio
# best for receipts, 1.6) left two columns' lines 3 px apart at the eval page's narrowest gutter.
INSET = 0.2


def group_rows(boxes: Sequence[Box]) -> list[list[int]]:
    """Indices of `boxes` grouped into rows (top to bottom), each row sorted left to right.

    A box joins the current row when it overlaps the row's mean band [mean y1, mean y2] by at
    least half the smaller of the two heights. Overlap rather than centre distance keeps a
    stylised word whose letters the detector boxed at different heights on one row, while two
    real lines, whose boxes overlap by their margins at most, stay apart.
    """
    rows: list[list[int]] = []
    for i in sorted(range(len(boxes)), key=lambda k: (boxes[k][1] + boxes[k][3]) / 2):
        _, y1, _, y2 = boxes[i]
        if rows:
            row = rows[-1]
            top = sum(boxes[k][1] for k in row) / len(row)
            bottom = sum(boxes[k][3] for k in row) / len(row)
            overlap = min(y2, bottom) - max(y1, top)
            if overlap >= 0.5 * min(y2 - y1, bottom - top):
                row.append(i)
                continue
        rows.append([i])
    for row in rows:
        row.sort(key=lambda k: boxes[k][0])
    return rows


def blocks(boxes: Sequence[Box]) -> list[list[int]]:
    """Indices of `boxes` grouped into blocks, in reading order (see the module docstring).

    Iterative rather than recursive: a staircase of a thousand boxes must not reach Python's
    recursion limit.
    """
    return _xy_cut(list(boxes), None)


def gutter_cuts(boxes: Sequence[Box]) -> dict[int, list[float]]:
    """Where to cut detected boxes that cross a column gutter, before they are read: box index
    -> the x of the middle of each gutter it crosses, left to right (see CROSSERS_PER_ROW).
    Empty for a page whose gutters are clear, and for a receipt, whose sides are no columns."""
    cuts: dict[int, list[float]] = {}
    _xy_cut(list(boxes), cuts)
    return {i: sorted(xs) for i, xs in cuts.items()}


def _xy_cut(boxes: list[Box], cuts: dict[int, list[float]] | None) -> list[list[int]]:
    """The XY-cut. With `cuts`, a line crossing a gutter is cut there: its part right of the
    gutter is appended to `boxes` (and so gets a new index) and the cut is recorded under the
    original index in `cuts`; without, crossers of about a line's height are set apart as a
    block of their own (they should have been cut before reading)."""
    leading = row_gap(boxes)
    origin = list(range(len(boxes)))
    done: list[list[int]] = []
    todo: list[list[int]] = [list(range(len(boxes)))] if boxes else []
    while todo:
        region = todo.pop()
        parts = _cut(boxes, region, leading)
        if parts is None:
            parts = _cut_crossed(boxes, region, origin, cuts, leading)
        if parts is None:
            done.append(region)
        else:
            todo += reversed(parts)  # the first part is popped, and so finished, first
    return done


def row_gap(boxes: Sequence[Box]) -> float:
    """The page's usual gap between one row and the next (the median; 0 where rows overlap)."""
    bands = [
        (min(boxes[k][1] for k in row), max(boxes[k][3] for k in row)) for row in group_rows(boxes)
    ]
    gaps = [below[0] - above[1] for above, below in pairwise(bands)]
    return max(0.0, median(gaps)) if gaps else 0.0


def _cut(boxes: Sequence[Box], region: list[int], leading: float) -> list[list[int]] | None:
    """The parts of `region` after one cut (across, else down), or None when it is one block."""
    if len(region) < 2:
        return None
    height = median(boxes[i][3] - boxes[i][1] for i in region)
    block_gap = leading + BLOCK_GAP * height
    across = _gaps([(boxes[i][1], boxes[i][3]) for i in region], block_gap)
    if across:
        parts = _split(boxes, region, across, axis=1)
        for k in range(len(parts) - 1):
            parts[k], parts[k + 1] = _decks_down(boxes, parts[k], parts[k + 1], block_gap)
        return parts
    down = _gaps([(boxes[i][0], boxes[i][2]) for i in region], COLUMN_GAP * height)
    if down:
        parts = _split(boxes, region, down, axis=0)
        if all(_is_column(boxes, part, height) for part in parts):
            return parts
    return None


def _cut_crossed(
    boxes: list[Box],
    region: list[int],
    origin: list[int],
    cuts: dict[int, list[float]] | None,
    leading: float,
) -> list[list[int]] | None:
    """The parts of `region` at a gutter that a few boxes cross (CROSSERS_PER_ROW), when both
    sides are columns without them; None when there is no such gutter."""
    if len(region) < 2 * COLUMN_MIN_ROWS:
        return None
    height = median(boxes[i][3] - boxes[i][1] for i in region)
    allowed = max(MIN_CROSSERS, int(CROSSERS_PER_ROW * len(group_rows([boxes[i] for i in region]))))
    inner = {i: _inset(boxes[i]) for i in region}
    for lo, hi in _sparse_runs(inner, region, allowed, COLUMN_GAP * height):
        mid = (lo + hi) / 2
        crossers = [i for i in region if inner[i][0] <= lo and inner[i][2] >= hi]
        crossing = set(crossers)
        rest = [i for i in region if i not in crossing]
        left = [i for i in rest if (boxes[i][0] + boxes[i][2]) / 2 < mid]
        right = [i for i in rest if (boxes[i][0] + boxes[i][2]) / 2 >= mid]
        if not (left and right and _is_column(boxes, left, height)):
            continue
        if not _is_column(boxes, right, height):
            continue
        narrower = min(left, right, key=lambda part: _width(boxes, part))
        if median(boxes[i][2] - boxes[i][0] for i in narrower) < LINE_FILL * _width(
            boxes, narrower
        ):
            continue
        headings = [i for i in crossers if boxes[i][3] - boxes[i][1] >= HEADING_HEIGHT * height]
        if headings:  # cut across at the top of the highest heading
            top = min(boxes[i][1] for i in headings)
            above = [i for i in region if (boxes[i][1] + boxes[i][3]) / 2 < top]
            below = [i for i in region if (boxes[i][1] + boxes[i][3]) / 2 >= top]
            if above and below:
                return list(_decks_down(boxes, above, below, leading + BLOCK_GAP * height))
            continue
        if cuts is None:
            return [left, right, crossers] if crossers else [left, right]
        for i in crossers:  # the part left of the gutter keeps the index
            x1, y1, x2, y2 = boxes[i]
            boxes[i] = (x1, y1, mid, y2)  # the halves touch; their insets leave the gutter
            boxes.append((mid, y1, x2, y2))
            origin.append(origin[i])
            cuts.setdefault(origin[i], []).append(mid)
            left.append(i)
            right.append(len(boxes) - 1)
        return [left, right]
    return None


def _decks_down(
    boxes: Sequence[Box], upper: list[int], lower: list[int], block_gap: float
) -> tuple[list[int], list[int]]:
    """`upper` and `lower`, two parts of a region cut across, with the decks of lower's heading
    moved down to it.

    A deck (or kicker) is a short block, fewer than COLUMN_MIN_ROWS rows, standing at the foot
    of its column right over the first row of the part below (its middle within that row's
    span), set apart from the column's own text above it by a block gap and nearer the row
    below than that text: by proximity it belongs to what follows, and a transcript reads it
    with the heading it stands on, after the columns beside it. The eval page's "Listen to the
    voices / of real experience" stands 4 px (v6's boxes; v4's: 37) over the title that spans
    the columns and 199 px under column 2's last line; read after column 2, it put the page's
    whole-text CER 2.1 points over the zoned CER.
    """
    if not upper or not lower:
        return upper, lower
    top = min(boxes[i][1] for i in lower)
    head = [i for i in lower if boxes[i][1] < top + block_gap]
    x1, x2 = min(boxes[i][0] for i in head), max(boxes[i][2] for i in head)
    by_top = sorted(upper, key=lambda i: boxes[i][1], reverse=True)  # from the foot up
    moved: set[int] = set()
    for foot in upper:
        fx1, _, fx2, fy2 = boxes[foot]
        if foot in moved or not x1 <= (fx1 + fx2) / 2 <= x2:
            continue
        if any(_over(boxes[j], boxes[foot]) for j in _starting_below(boxes, by_top, fy2)):
            continue  # not the foot of its column
        deck = _stack_up(boxes, by_top, foot, block_gap, COLUMN_MIN_ROWS)
        if len(group_rows([boxes[i] for i in deck])) >= COLUMN_MIN_ROWS:
            continue
        y1, y2 = min(boxes[i][1] for i in deck), max(boxes[i][3] for i in deck)
        over = [
            j
            for j in upper
            if j not in deck and boxes[j][1] < y1 and any(_over(boxes[j], boxes[i]) for i in deck)
        ]
        if not over:
            continue  # no column over it: nothing to be set apart from
        nearest = max(over, key=lambda j: boxes[j][3])
        column = _stack_up(boxes, by_top, nearest, block_gap, COLUMN_MIN_ROWS)
        if len(group_rows([boxes[i] for i in column])) < COLUMN_MIN_ROWS:
            continue
        cx1, cx2 = min(boxes[i][0] for i in column), max(boxes[i][2] for i in column)
        if any(
            j not in deck
            and boxes[j][1] < y2
            and boxes[j][3] > y1
            and boxes[j][2] > cx1
            and boxes[j][0] < cx2
            for j in upper
        ):
            continue  # its rows hold more of that column's text: a line's parts, not a deck
        apart = y1 - boxes[nearest][3]
        if apart >= block_gap and top - y2 < apart:
            moved |= deck
    if not moved or len(moved) == len(upper):  # the whole part is no deck: cut as it was
        return upper, lower
    return [i for i in upper if i not in moved], [*sorted(moved), *lower]


def _starting_below(boxes: Sequence[Box], by_top: list[int], y: float) -> Iterator[int]:
    """The boxes of `by_top` (sorted by top, lowest first) whose top is at or below `y`."""
    for j in by_top:
        if boxes[j][1] < y:
            return
        yield j


def _stack_up(
    boxes: Sequence[Box], by_top: list[int], foot: int, block_gap: float, enough_rows: int
) -> set[int]:
    """`foot` and the boxes of `by_top` (sorted by top, lowest first) stacked over it, each
    less than `block_gap` above one already taken and overlapping it along x; the stack stops
    growing once it has `enough_rows` rows (all the caller needs to know, and what keeps a
    page of long columns from costing the square of its boxes at every foot)."""
    stack = [foot]
    for j in by_top:  # a box can only rest on boxes whose tops are lower: seen before it
        if j == foot or boxes[j][1] >= boxes[foot][1]:
            continue
        if any(
            _over(boxes[j], boxes[i])
            and boxes[i][1] - boxes[j][3] < block_gap
            and boxes[j][1] < boxes[i][1]
            for i in stack
        ):
            stack.append(j)
            if len(group_rows([boxes[i] for i in stack])) >= enough_rows:
                break
    return set(stack)


def _over(a: Box, b: Box) -> bool:
    """Whether two boxes overlap along x."""
    return min(a[2], b[2]) > max(a[0], b[0])


def _inset(box: Box) -> Box:
    """The box less the margin the detector grows it by on its left and right (INSET x its
    height each side, keeping at least half its width), for finding gutters between boxes."""
    x1, y1, x2, y2 = box
    d = min(INSET * (y2 - y1), (x2 - x1) / 4)
    return (x1 + d, y1, x2 - d, y2)


def _width(boxes: Sequence[Box], part: list[int]) -> float:
    return max(boxes[i][2] for i in part) - min(boxes[i][0] for i in part)


def _sparse_runs(
    boxes: Sequence[Box] | dict[int, Box], region: list[int], allowed: int, least: float
) -> list[tuple[float, float]]:
    """Stretches along x, inside the region, at least `least` wide, covered by at most `allowed`
    boxes at every point: (start, end), left to right."""
    change: dict[float, int] = {}
    for i in region:
        change[boxes[i][0]] = change.get(boxes[i][0], 0) + 1
        change[boxes[i][2]] = change.get(boxes[i][2], 0) - 1
    edges = sorted(change)
    runs: list[tuple[float, float]] = []
    covered, start = 0, None
    for a in edges[:-1]:  # `covered` is then the count from a to the next edge
        covered += change[a]
        if covered <= allowed:
            start = a if start is None else start
        elif start is not None:
            runs.append((start, a))
            start = None
    return [(lo, hi) for lo, hi in runs if hi - lo >= least]


def _gaps(spans: list[tuple[float, float]], least: float) -> list[float]:
    """Where along one axis the spans leave a gap at least `least` wide: its far edge."""
    spans.sort()
    edges = []
    end = spans[0][1]
    for start, stop in spans[1:]:
        if start - end >= least:
            edges.append(start)
        end = max(end, stop)
    return edges


def _split(
    boxes: Sequence[Box], region: list[int], edges: list[float], axis: int
) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(len(edges) + 1)]
    for i in region:
        parts[sum(boxes[i][axis] >= edge for edge in edges)].append(i)
    return parts


def _is_column(boxes: Sequence[Box], part: list[int], height: float) -> bool:
    width = max(boxes[i][2] for i in part) - min(boxes[i][0] for i in part)
    if width < COLUMN_MIN_WIDTH * height:
        return False
    return len(group_rows([boxes[i] for i in part])) >= COLUMN_MIN_ROWS


def read_blocks(pieces: Sequence[Piece], merge_gap: float) -> list[list[Piece]]:
    """The page's blocks in reading order, each its lines in reading order (`merge_rows` within
    the block, so two columns a narrow gutter apart are never merged into one line)."""
    boxes = [p[1] for p in pieces]
    return [merge_rows([pieces[i] for i in block], merge_gap) for block in blocks(boxes)]


def merge_rows(pieces: Sequence[Piece], merge_gap: float) -> list[Piece]:
    """Reading order, with close neighbours on one row merged into one line.

    Neighbours merge when the gap between them is at most `merge_gap` line heights, about a word
    space: the detector sometimes splits a line there. Page columns (or the two sides of a
    receipt line) lie further apart and stay separate lines whose boxes still mean something:
    on the 3-column tesseract page, merging gaps up to 1.0 line height glued columns together
    (zoned CER 0.58), 0.5 still did on some rows (0.05), 0.3 kept them apart (0.0095). The
    merged score is the character-weighted mean.
    """
    boxes = [p[1] for p in pieces]
    merged: list[Piece] = []
    for row in group_rows(boxes):
        group = [pieces[row[0]]]
        for k in row[1:]:
            prev, box = group[-1][1], boxes[k]
            height = max(prev[3] - prev[1], box[3] - box[1])
            if box[0] - prev[2] <= merge_gap * height:
                group.append(pieces[k])
            else:
                merged.append(_join(group))
                group = [pieces[k]]
        merged.append(_join(group))
    return merged


def _join(group: Sequence[Piece]) -> Piece:
    box = union([p[1] for p in group])
    weights = [max(len(p[0]), 1) for p in group]
    score = sum(w * p[2] for w, p in zip(weights, group, strict=True)) / sum(weights)
    return " ".join(p[0] for p in group), box, score


def union(boxes: Sequence[Box]) -> Box:
    return (
        min(b[0] for b in boxes),
        min(b[1] for b in boxes),
        max(b[2] for b in boxes),
        max(b[3] for b in boxes),
    )
