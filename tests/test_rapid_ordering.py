"""Reading order of the CPU engine (ocrq/models/rapid/ordering.py) on boxes its detector found
on real eval images (tests/rapid_detected_boxes.json): a magazine page read column by column,
receipts read row by row as before. Pure geometry, no model: milliseconds."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from ocrq.models.rapid.ordering import Box, Piece, blocks, gutter_cuts, merge_rows, read_blocks

BOXES = Path(__file__).with_name("rapid_detected_boxes.json")
MERGE_GAP = 0.3  # RapidEngine's default


def pieces(name: str) -> list[Piece]:
    rows = json.loads(BOXES.read_text(encoding="utf-8"))[name]
    return [(text, (b[0], b[1], b[2], b[3]), score) for text, b, score in rows]


def column(line: Piece) -> int:
    """Which of the page's four text columns holds a line (the .uzn zones' x ranges)."""
    x = (line[1][0] + line[1][2]) / 2
    return sum(x > edge for edge in (830, 1600, 2400))


def test_a_three_column_page_reads_column_by_column() -> None:
    read = read_blocks(pieces("page_8071_093"), MERGE_GAP)
    # Each column its own block, then the deck standing on the title, the title's rows.
    assert [block[0][0] for block in read] == [
        "HE MoPED. She sighed. She",
        "cause of her sadness. Gently, sim--",
        "Guarendi's book shows that tradi-",
        "one day when he was trying to",
        "Listen to the voices",
        "What Kids",
        "PhOTO: O PAUL BaATON/THe StOCK MaRKET",
    ]
    body = [line for block in read[:4] for line in block]
    assert all(line[1][3] < 1820 for line in body)
    columns = [column(line) for line in body]
    assert columns == sorted(columns), "a line of one column read inside another"
    texts = [line[0] for line in body]
    # The end of a column runs on into the top of the next, not into its neighbour's line 2.
    at = texts.index("questioned her until he learned the")
    assert texts[at + 1] == "cause of her sadness. Gently, sim--"
    at = texts.index("lar had this confirmed in reverse")
    assert texts[at + 1] == "one day when he was trying to"


@pytest.mark.parametrize("name", ["receipt_086", "receipt_211", "receipt_548"])
def test_a_receipt_keeps_its_rows(name: str) -> None:
    """Each receipt has a column of prices clear of the items beside it, which must not be
    read as a page column: the lines come out as the row-by-row order had them."""
    found = pieces(name)
    read = read_blocks(found, MERGE_GAP)
    assert [line for block in read for line in block] == merge_rows(found, MERGE_GAP)
    assert len(read) > 1  # its sections, a blank line apart in the text


def test_boxes_across_a_gutter_are_cut_there_and_the_columns_read_apart() -> None:
    """PP-OCRv6's detector joins the first lines of columns 1-2 and 3-4 of the page (and runs a
    line of column 1 into column 2), so no gutter is clear of boxes: each such box is cut at the
    gutter, and then every block lies within one column, read in column order."""
    found = [box for _, box, _ in pieces("page_8071_093_v6")]
    cuts = gutter_cuts(found)
    assert sorted(len(xs) for xs in cuts.values()) == [1, 1, 1]
    gutters = sorted({round(x) for xs in cuts.values() for x in xs})
    assert len(gutters) == 2
    assert 790 < gutters[0] < 840 and 2370 < gutters[1] < 2420  # between the zones' x ranges
    cut: list[Box] = []
    for k, (x1, y1, x2, y2) in enumerate(found):
        edges = [x1, *cuts.get(k, []), x2]
        cut += [(a, y1, b, y2) for a, b in pairwise(edges)]
    found_blocks = blocks(cut)
    body = [[column(("", cut[i], 1.0)) for i in block] for block in found_blocks[:4]]
    assert all(len(set(c)) == 1 for c in body), "a block holds two columns' lines"
    assert [c[0] for c in body] == [0, 1, 2, 3]
    assert all(cut[i][1] >= 1683 for block in found_blocks[4:] for i in block)  # deck, title


def deck_page(deck_gap: float, title_gap: float) -> tuple[list[Box], list[int], list[int]]:
    """A left column of 10 lines (40 px tall, 50 px apart), a 2-line block under it `deck_gap`
    px below its text, a title spanning the page `title_gap` px under that block and a right
    column running down to the title: boxes, the deck's indices and the right column's."""
    boxes: list[Box] = [(0.0, 50.0 * r, 600.0, 50.0 * r + 40.0) for r in range(10)]
    top = 490.0 + deck_gap
    deck = [len(boxes), len(boxes) + 1]
    boxes += [(60.0, top, 500.0, top + 45.0), (60.0, top + 50.0, 450.0, top + 95.0)]
    title = top + 95.0 + title_gap
    rows = int((title - 45.0) // 50.0) + 1
    right = list(range(len(boxes), len(boxes) + rows))
    boxes += [(700.0, 50.0 * r, 1300.0, 50.0 * r + 40.0) for r in range(rows)]
    boxes.append((0.0, title, 1300.0, title + 120.0))
    return boxes, deck, right


def test_a_deck_standing_on_a_title_is_read_with_it_after_the_columns() -> None:
    """A short block under a column, a block gap below the column's text and nearer the title
    spanning the columns (the eval page's "Listen to the voices / of real experience"), is read
    after both columns, just before the title; nearer its column, it stays after it."""
    boxes, deck, right = deck_page(deck_gap=200.0, title_gap=5.0)
    assert [sorted(b) for b in blocks(boxes)] == [list(range(10)), right, [*deck, len(boxes) - 1]]
    boxes, deck, right = deck_page(deck_gap=60.0, title_gap=100.0)
    assert [sorted(b) for b in blocks(boxes)] == [list(range(10)), deck, right, [len(boxes) - 1]]


@pytest.mark.parametrize("name", ["receipt_086", "receipt_211", "receipt_548"])
def test_no_receipt_box_is_cut(name: str) -> None:
    """A receipt's prices beside its item lines are no column, crossed or not."""
    assert gutter_cuts([box for _, box, _ in pieces(name)]) == {}


def test_evenly_spaced_lines_are_one_block_and_a_wide_gap_parts_them() -> None:
    # Lines 64 px apart, 34 px tall: ocrq's own sample images (0.9 line heights between them).
    even = [(10.0, 30.0 + 64 * i, 300.0, 64.0 + 64 * i) for i in range(5)]
    assert blocks(even) == [[0, 1, 2, 3, 4]]
    spaced = even[:3] + [(10.0, 300.0 + 64 * i, 300.0, 334.0 + 64 * i) for i in range(2)]
    assert blocks(spaced) == [[0, 1, 2], [3, 4]]


def test_two_columns_of_short_rows_are_a_table_not_columns() -> None:
    # Item and price a wide gap apart on every row: read row by row, whatever the gap.
    rows = [(10.0, 10.0 + 40 * i, 300.0, 40.0 + 40 * i) for i in range(6)]
    prices = [(700.0, 10.0 + 40 * i, 800.0, 40.0 + 40 * i) for i in range(6)]
    boxes = [b for pair in zip(rows, prices, strict=True) for b in pair]
    assert blocks(boxes) == [list(range(12))]
