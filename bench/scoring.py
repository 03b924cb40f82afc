"""OCR accuracy measures and the reader of the shared evaluation set (ocr-eval/manifest.tsv).

Pure functions with no engine imports, so benchmarks and tests score every engine the same way.
Here in bench/ and not in the installed package: the service never scores anything, only the
accuracy benchmarks and the CPU engine's accuracy test do (tests may import bench; nothing
imports tests). Named for what it holds: ocrq/core/metrics.py is the worker's Prometheus metrics.
The measures follow the eval set's README: normalised exact match for word crops, multiset token
F1 for receipts (their line order is only roughly reading order, so an order-free measure is the
fair one), character error rate for pages, and recall for the partially annotated scene photos.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "manifest.tsv"


# --------------------------------------------------------------------------------------------
# measures


def normalize_word(s: str) -> str:
    """Upper-case and keep letters and digits: SVT labels are bare upper-case words, so case and
    punctuation an engine adds around a word ("Forum," vs "FORUM") must not count as errors."""
    return "".join(ch for ch in s.upper() if ch.isalnum())


def word_accuracy(preds: Sequence[str], gts: Sequence[str]) -> float:
    """Fraction of predictions equal to their ground truth after `normalize_word`."""
    if len(preds) != len(gts):
        raise ValueError(f"{len(preds)} predictions for {len(gts)} ground truths")
    if not gts:
        raise ValueError("word accuracy of an empty set is undefined")
    hits = sum(normalize_word(p) == normalize_word(g) for p, g in zip(preds, gts, strict=True))
    return hits / len(gts)


def tokens(text: str) -> list[str]:
    """Upper-cased whitespace tokens: the unit of the receipt and page token measures."""
    return text.upper().split()


def token_counts(pred_text: str, gt_text: str) -> tuple[int, int, int]:
    """(matched, predicted, ground-truth) token counts, multiset matching.

    Returned as counts rather than ratios so callers can also pool them over a data set
    (micro F1), where one long receipt weighs as much as its tokens.
    """
    pred, gt = Counter(tokens(pred_text)), Counter(tokens(gt_text))
    matched = sum((pred & gt).values())
    return matched, sum(pred.values()), sum(gt.values())


def f1_from_counts(matched: int, n_pred: int, n_gt: int) -> tuple[float, float, float]:
    """Precision, recall, F1 from counts; an empty prediction for an empty truth is perfect."""
    if n_pred == 0 and n_gt == 0:
        return 1.0, 1.0, 1.0
    precision = matched / n_pred if n_pred else 0.0
    recall = matched / n_gt if n_gt else 0.0
    if precision + recall == 0:
        return precision, recall, 0.0
    return precision, recall, 2 * precision * recall / (precision + recall)


def token_f1(pred_text: str, gt_text: str) -> tuple[float, float, float]:
    """Precision, recall and F1 of the multiset of upper-cased whitespace tokens."""
    return f1_from_counts(*token_counts(pred_text, gt_text))


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; unit costs).

    Bit-parallel (Myers 1999 / Hyyrö 2003) over Python's big integers: one pass over `b` with a
    handful of integer operations per character, so a 4,000-character page takes milliseconds
    where the textbook O(len(a)*len(b)) table would take seconds in pure Python.
    """
    if not a:
        return len(b)
    if not b:
        return len(a)
    m = len(a)
    mask = (1 << m) - 1
    high = 1 << (m - 1)
    peq: dict[str, int] = {}
    for i, ch in enumerate(a):
        peq[ch] = peq.get(ch, 0) | (1 << i)
    pv, mv, dist = mask, 0, m  # vertical +1 / -1 deltas of the current column; D[m][j]
    for ch in b:
        eq = peq.get(ch, 0)
        xv = eq | mv
        xh = ((((eq & pv) + pv) & mask) ^ pv) | eq
        ph = (mv | ~(xh | pv)) & mask
        mh = pv & xh
        if ph & high:
            dist += 1
        elif mh & high:
            dist -= 1
        ph = ((ph << 1) | 1) & mask  # row 0 of the table grows by one per column
        mh = (mh << 1) & mask
        pv = (mh | ~(xv | ph)) & mask
        mv = ph & xv
    return dist


def collapse_whitespace(text: str) -> str:
    """One space between words: line breaks and indentation are layout, not characters read."""
    return " ".join(text.split())


def cer(pred: str, gt: str) -> float:
    """Character error rate: edit distance / ground-truth length, whitespace runs collapsed.

    Can exceed 1.0 when the prediction is much longer than the truth.
    """
    pred, gt = collapse_whitespace(pred), collapse_whitespace(gt)
    if not gt:
        return 0.0 if not pred else 1.0
    return levenshtein(pred, gt) / len(gt)


def word_recall(pred_text: str, gt_words: Sequence[str]) -> tuple[int, int]:
    """(found, total): ground-truth words that appear among the predicted words.

    Each predicted word can satisfy one ground-truth word (multiset matching) so a word read
    once does not count for two identical labels. Words compare after `normalize_word`.
    """
    pred = Counter(w for w in (normalize_word(t) for t in pred_text.split()) if w)
    gt = Counter(w for w in (normalize_word(t) for t in gt_words) if w)
    return sum((pred & gt).values()), sum(gt.values())


# --------------------------------------------------------------------------------------------
# the evaluation set


@dataclass(frozen=True)
class EvalImage:
    """One row of manifest.tsv with its paths resolved against the data folder."""

    dataset: str  # "svt", "sroie" or "tesseract_test"
    image_path: Path
    ground_truth_path: Path
    width: int
    height: int
    bytes: int
    gt_format: str

    @property
    def kind(self) -> str:
        """The measure family: "svt_word", "svt_scene", "sroie" or "page"."""
        if self.dataset == "svt":
            return "svt_scene" if self.image_path.parent.name == "scene" else "svt_word"
        if self.dataset == "sroie":
            return "sroie"
        return "page"

    @property
    def name(self) -> str:
        return self.image_path.stem


def load_manifest(root: Path) -> list[EvalImage]:
    """Read `root/manifest.tsv`; raise FileNotFoundError naming the path when it is absent."""
    manifest = Path(root) / MANIFEST_NAME
    if not manifest.is_file():
        raise FileNotFoundError(f"evaluation manifest not found: {manifest}")
    with manifest.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    return [
        EvalImage(
            dataset=row["dataset"],
            image_path=manifest.parent / row["image_path"],
            ground_truth_path=manifest.parent / row["ground_truth_path"],
            width=int(row["width"]),
            height=int(row["height"]),
            bytes=int(row["bytes"]),
            gt_format=row.get("gt_format", ""),
        )
        for row in rows
    ]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def ground_truth_text(entry: EvalImage) -> str:
    """The text an engine should read from the image.

    SVT crop: one word. SROIE: text/NNN.txt (box transcripts one per line; the manifest points
    at box/NNN.csv, whose coordinates token F1 does not need). Page: NAME.txt. SVT scene: the
    annotated words joined by spaces (a partial truth; score it with `word_recall` only).
    """
    kind = entry.kind
    if kind == "svt_word":
        return _read(entry.ground_truth_path).strip()
    if kind == "sroie":
        text_path = entry.ground_truth_path.parent.parent / "text" / f"{entry.name}.txt"
        return _read(text_path)
    if kind == "svt_scene":
        return " ".join(scene_words(entry))
    return _read(entry.ground_truth_path)


def scene_words(entry: EvalImage) -> list[str]:
    """The annotated words of an SVT scene (NAME.tsv: x, y, width, height, text)."""
    with entry.ground_truth_path.open(newline="", encoding="utf-8") as fh:
        return [row["text"] for row in csv.DictReader(fh, delimiter="\t")]


def page_zones(entry: EvalImage) -> list[tuple[int, int, int, int]]:
    """Transcribed zones (x, y, width, height) of a page, from NAME.uzn; [] when it has none.

    On the *.3B pages only these zones are transcribed, in this order, so a fair page CER
    compares the text read inside them, zone by zone.
    """
    uzn = entry.ground_truth_path.with_suffix(".uzn")
    if not uzn.is_file():
        return []
    zones = []
    for line in _read(uzn).splitlines():
        parts = line.split()
        if len(parts) >= 4:
            x, y, w, h = (int(p) for p in parts[:4])
            zones.append((x, y, w, h))
    return zones
