"""CPU engine: PaddleOCR's PP-OCRv4 ONNX models as shipped inside the rapidocr-onnxruntime wheel.

Why not call `RapidOCR()` per image: it reads one image at a time, so the classifier and the
recogniser would see a handful of crops per call. Here detection runs per image (sizes differ),
then the crops of ALL images of the batch go through the classifier and the recogniser together,
grouped by padded input width so that no crop's reading depends on its batch-mates.

Departures from the library's own pipeline, each measured on the shared eval set
(bench/results/accuracy_rapid.md has the figures):

* Small images (shorter side <= LINE_MAX_SIDE) may be tight word or line crops, on which the
  library's detector, run on an upscaled copy, finds no box or a wrong one (it reads 8% of the SVT
  word crops). They are detected at their own scale on a padded canvas instead, and unless that
  finds two or more rows of text the whole image is read as one line. Any image the detector
  finds nothing on is read whole too.
* The recogniser (a Chinese+English model) seldom emits the space between English words on
  receipts, which ruins token-level results (SROIE token F1 0.57). A space is inserted where a
  blank gap in the crop, wide for the text's size and for its letter spacing, lies between two
  characters (`word_gaps`).
* Crops are cut from the image as handed in, not from the detector's downscaled copy: a 4961x7016
  receipt is detected at 1414x2000 but its lines are read at full resolution.
* Lines come back top-to-bottom, left-to-right; boxes on one row a word space apart are merged
  into one Line, boxes further apart (page columns, the two sides of a receipt line) are not.

Nothing is downloaded: the model files ship with the wheel, and `load()` fails at start-up with a
clear error when they are missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image

from models.base import Engine, Line, OcrResult, PreparedImage, UnsupportedTask
from models.costs import CostModel, ItemCost
from ocrq.contract import TASKS

SUPPORTED_TASKS = ("text", "spotting", "parse")
MODEL_FILES = {
    "det": "ch_PP-OCRv4_det_infer.onnx",
    "cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "rec": "ch_PP-OCRv4_rec_infer.onnx",
}

# The library's resize limits (rapidocr_onnxruntime/config.yaml): a page is first brought to a long
# side <= MAX_SIDE_LEN, then the detector upscales it until its SHORT side is >= DET_LIMIT_SIDE_LEN.
MAX_SIDE_LEN = 2000
MIN_SIDE_LEN = 30
DET_LIMIT_SIDE_LEN = 736
LETTERBOX_MIN_HEIGHT = 30
LETTERBOX_MAX_RATIO = 8
REC_HEIGHT = 48
REC_MIN_WIDTH = 320  # the recogniser input is at least this wide (the library's shape)

# Possible word/line crops: shorter side <= LINE_MAX_SIDE (SVT word crops are 17..247 px tall).
# They are detected unscaled, on a canvas padded by LINE_PAD x their shorter side, capped at
# LINE_DET_MAX_SIDE. Measured on the 125 SVT crops: 0.56 word accuracy when detected like pages
# with a whole-image fallback, 0.89 when read whole, 0 of them found to hold two rows this way.
LINE_MAX_SIDE = 256
LINE_PAD = 0.5
LINE_DET_MAX_SIDE = 960
# A crop read whole that is narrower than WIDEN_TO_RATIO:1 is stretched horizontally (by at most
# WIDEN_MAX) before recognition: the recogniser emits one step per 8 input pixels, and short
# words in near-square crops got too few (SVT crops read whole: 0.888 -> 0.912 in a sweep of the
# recogniser alone, flat for target ratios 2.5-3 and caps 1.25-2x).
WIDEN_TO_RATIO = 3.0
WIDEN_MAX = 1.5
# A blank column run is a word space when at least SPACE_GAP_RATIO x the ink height and
# SPACE_GAP_OVER_MEDIAN x the crop's median blank run (see `word_gaps`). SROIE token F1: 0.57
# without spaces, 0.80 with these; 0.73-0.81 over ratios 0.2-0.35 x multiples 1.5-3 and 0.50-0.74
# without the median term; page CER unchanged. A multiple of 2 missed the space of "LINE 42" in
# Pillow's default font (letter gaps up to 7 px, that space 11 px at 40 px).
SPACE_GAP_RATIO = 0.3
SPACE_GAP_OVER_MEDIAN = 1.75
# The recogniser's input width for a crop depends on that crop alone (its own width rounded up
# to REC_WIDTH_STEP), never on its batch-mates: what the model reads shifts with the padding, so
# padding to the widest crop of a call (as the library does) made results depend on the batch.
# Measured peak RSS growth of one call (batch x 48 x width): 16x320 95 MiB, 16x1920 315 MiB,
# 16x3840 540 MiB, 1x7680 148 MiB, so ~55 MiB + 8 KiB per padded column: a call holds at most
# REC_MAX_CALL_COLUMNS (16 crops of 960), about 180 MiB.
REC_WIDTH_STEP = 64
REC_MAX_CALL_COLUMNS = 15_360

# Host-memory model (see `cost_model()` for how it was measured): the process with the engine
# loaded, the workspace one run() needs whatever its size, and a term per detector patch.
LOADED_RSS_BYTES = 192 * 1024**2
RUN_WORKSPACE_BYTES = 512 * 1024**2
PER_PATCH_BYTES = 64 * 1024.0

Box = tuple[float, float, float, float]


# ------------------------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class DetPlan:
    """How one image is put in front of the detector, and how its boxes map back.

    resized: the image's size on the canvas; pad: (x, y) border added on each side; det_input:
    the size the network sees; line_candidate: a small image that is read whole unless the
    detector finds at least two rows of text on it.
    """

    resized: tuple[int, int]
    pad: tuple[int, int]
    det_input: tuple[int, int]
    line_candidate: bool


def _round32(x: float) -> int:
    return max(32, int(round(x / 32) * 32))


def _page_plan(w: int, h: int) -> DetPlan:
    """The library's steps, as arithmetic: max/min side limits, letterbox, 736 min-side upscale."""
    if max(w, h) > MAX_SIDE_LEN:
        ratio = MAX_SIDE_LEN / max(w, h)
        w, h = _round32(int(w * ratio)), _round32(int(h * ratio))
    if min(w, h) < MIN_SIDE_LEN:
        ratio = MIN_SIDE_LEN / min(w, h)
        w, h = _round32(int(w * ratio)), _round32(int(h * ratio))
    pad_y = 0
    if h <= LETTERBOX_MIN_HEIGHT or w / h > LETTERBOX_MAX_RATIO:
        pad_y = abs(max(int(w / LETTERBOX_MAX_RATIO), LETTERBOX_MIN_HEIGHT) * 2 - h) // 2
    cw, ch = w, h + 2 * pad_y
    scale = max(1.0, DET_LIMIT_SIDE_LEN / min(cw, ch))
    det_input = (_round32(int(cw * scale)), _round32(int(ch * scale)))
    return DetPlan((w, h), (0, pad_y), det_input, False)


def _line_plan(w: int, h: int) -> DetPlan:
    """A small image at its own scale, padded so text touching its edges is still found."""
    pad = int(LINE_PAD * min(w, h))
    cw, ch = w + 2 * pad, h + 2 * pad
    scale = min(1.0, LINE_DET_MAX_SIDE / max(cw, ch))
    return DetPlan((w, h), (pad, pad), (_round32(cw * scale), _round32(ch * scale)), True)


def det_plan(w: int, h: int) -> DetPlan:
    """Detector geometry for a w x h image, computed without pixels.

    Shared by `estimate` and `run`, so the pixels the planner counts are the pixels that run.
    """
    if w <= 0 or h <= 0:
        raise ValueError(f"image of {w}x{h} pixels has nothing to read")
    return _line_plan(w, h) if min(w, h) <= LINE_MAX_SIDE else _page_plan(w, h)


# ------------------------------------------------------------------------------------ pixels


def to_bgr(image: Image.Image) -> np.ndarray:
    """PIL image -> contiguous BGR uint8 array, the channel order the models were trained on."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    rgb = np.asarray(image)
    if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise ValueError(f"image has no pixels (array shape {rgb.shape})")
    return np.ascontiguousarray(rgb[:, :, ::-1])


def crop_quad(img: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """Rectify the quadrilateral `quad` (tl, tr, br, bl) of `img` into an upright crop.

    A crop much taller than wide is turned a quarter so vertical text runs left to right, as the
    recogniser expects.
    """
    quad = quad.astype(np.float32)
    width = int(max(np.linalg.norm(quad[0] - quad[1]), np.linalg.norm(quad[2] - quad[3])))
    height = int(max(np.linalg.norm(quad[0] - quad[3]), np.linalg.norm(quad[1] - quad[2])))
    width, height = max(width, 1), max(height, 1)
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(quad, target)
    crop = cv2.warpPerspective(
        img, matrix, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC
    )
    return upright(crop)


def upright(img: np.ndarray) -> np.ndarray:
    """Turn a crop a quarter when it is much taller than wide (vertical text)."""
    h, w = img.shape[:2]
    return np.ascontiguousarray(np.rot90(img)) if h / w >= 1.5 else img


def widen(img: np.ndarray) -> np.ndarray:
    """Stretch a narrow whole-image crop horizontally (see WIDEN_TO_RATIO)."""
    h, w = img.shape[:2]
    factor = min(WIDEN_TO_RATIO * h / w, WIDEN_MAX)
    if factor <= 1.0:
        return img
    return cv2.resize(img, (round(w * factor), h), interpolation=cv2.INTER_CUBIC)


def shrink_to_rec_height(img: np.ndarray) -> np.ndarray:
    """Bring a crop taller than the recogniser's input down to it by area averaging.

    The library lets the recogniser's bilinear resize do it, which aliases thin strokes when
    shrinking a tall crop (a word crop from a photo, a line of a 600 dpi scan) several times
    (SVT 0.904 -> 0.912, SROIE unchanged).
    """
    h, w = img.shape[:2]
    if h <= REC_HEIGHT:
        return img
    size = (max(1, round(w * REC_HEIGHT / h)), REC_HEIGHT)
    return cv2.resize(img, size, interpolation=cv2.INTER_AREA)


def rec_input_width(crop: np.ndarray) -> int:
    """Padded recogniser input width for a crop: its width at REC_HEIGHT, rounded up to
    REC_WIDTH_STEP, at least REC_MIN_WIDTH (the library's narrowest input)."""
    h, w = crop.shape[:2]
    own = math.ceil(REC_HEIGHT * w / h)
    return max(REC_MIN_WIDTH, math.ceil(own / REC_WIDTH_STEP) * REC_WIDTH_STEP)


def rec_input(crop: np.ndarray, width: int) -> np.ndarray:
    """The recogniser's input for one crop: REC_HEIGHT tall, scaled to [-1, 1], left-aligned and
    zero-padded (mid-grey once scaled) to `width` columns, as the model was trained."""
    h, w = crop.shape[:2]
    resized_w = min(width, math.ceil(REC_HEIGHT * w / h))
    resized = cv2.resize(crop, (resized_w, REC_HEIGHT)).astype(np.float32)
    out = np.zeros((3, REC_HEIGHT, width), dtype=np.float32)
    out[:, :, :resized_w] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return out


def word_gaps(crop: np.ndarray) -> list[float]:
    """Centres (x) of blank column runs wide enough to be spaces between words.

    A run is a space when it is at least SPACE_GAP_RATIO x the height of the ink (the text's own
    size, whatever margin the crop has) and SPACE_GAP_OVER_MEDIAN x the crop's median blank run
    (the gap between letters, wide in the monospaced print of receipts). Ink is the minority
    class after Otsu binarisation, so dark-on-light and light-on-dark text both work; blank runs
    before the first and after the last ink column are margins, not gaps.
    """
    gray = cv2.cvtColor(crop, cv2.COLOR_BGR2GRAY)
    _, binary = cv2.threshold(gray, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    ink = binary == 0
    if ink.mean() > 0.5:
        ink = ~ink
    cols = np.flatnonzero(ink.any(axis=0))
    rows = np.flatnonzero(ink.any(axis=1))
    if cols.size < 2:
        return []
    blanks = np.diff(cols) - 1  # blank columns between consecutive inked columns
    runs = blanks[blanks > 0]
    if runs.size == 0:
        return []
    ink_height = rows[-1] - rows[0] + 1
    min_gap = max(SPACE_GAP_RATIO * ink_height, SPACE_GAP_OVER_MEDIAN * float(np.median(runs)))
    return [float(cols[i] + (blanks[i] + 1) / 2) for i in np.flatnonzero(blanks >= min_gap)]


def is_wide_char(ch: str) -> bool:
    """CJK and other wide scripts, written without spaces between words."""
    return ord(ch) >= 0x2E80


# ------------------------------------------------------------------------------------ ordering


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


def merge_rows(
    pieces: Sequence[tuple[str, Box, float]], merge_gap: float
) -> list[tuple[str, Box, float]]:
    """Reading order, with close neighbours on one row merged into one line.

    Neighbours merge when the gap between them is at most `merge_gap` line heights, about a word
    space: the detector sometimes splits a line there. Page columns (or the two sides of a
    receipt line) lie further apart and stay separate lines whose boxes still mean something:
    on the 3-column tesseract page, merging gaps up to 1.0 line height glued columns together
    (zoned CER 0.58), 0.5 still did on some rows (0.05), 0.3 kept them apart (0.0095). The
    merged score is the character-weighted mean.
    """
    boxes = [p[1] for p in pieces]
    merged: list[tuple[str, Box, float]] = []
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


def _join(group: Sequence[tuple[str, Box, float]]) -> tuple[str, Box, float]:
    box = _union([p[1] for p in group])
    weights = [max(len(p[0]), 1) for p in group]
    score = sum(w * p[2] for w, p in zip(weights, group, strict=True)) / sum(weights)
    return " ".join(p[0] for p in group), box, score


# ------------------------------------------------------------------------------------ engine


def unsupported_task(task: str) -> UnsupportedTask:
    """The per-item error for a task this engine cannot do, naming the engine that can."""
    what = f"task {task!r}" if task in TASKS else "free prompts"
    return UnsupportedTask(
        f"engine 'rapid' supports tasks {', '.join(SUPPORTED_TASKS)}; "
        f"use --engine hunyuan for {what}"
    )


def default_model_dir() -> Path:
    """The models folder inside the installed rapidocr-onnxruntime wheel (found, not imported)."""
    spec = util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "engine 'rapid' needs rapidocr-onnxruntime==1.4.4: pip install 'ocrq[cpu]'"
        )
    return Path(spec.origin).parent / "models"


@dataclass
class _Piece:
    """One region of one image: its box in image pixels, its crop, and then its reading."""

    box: Box
    crop: np.ndarray
    whole: bool  # the whole image read as one line: no direction classifier, widened
    text: str = ""
    score: float = 0.0


class RapidEngine(Engine):
    """PP-OCRv4 detection, direction classifier and recognition on onnxruntime (CPU)."""

    name = "rapid"

    def __init__(
        self,
        rec_batch_size: int = 16,
        text_score: float = 0.5,
        intra_op_threads: int | None = None,
        merge_gap: float = 0.3,
        box_thresh: float = 0.5,
        unclip_ratio: float = 1.6,
        model_dir: Path | None = None,
    ) -> None:
        """
        rec_batch_size: crops per classifier/recogniser call, across all images of a batch.
        text_score: lines read with a lower mean character confidence are dropped.
        intra_op_threads: onnxruntime threads per session; None lets onnxruntime decide (one per
            physical core), right unless several engines share the host.
        merge_gap: boxes on one row closer than this many line heights become one Line.
        box_thresh, unclip_ratio: the DB detector's box score floor and box growth.
        model_dir: where the three .onnx files are; default the rapidocr-onnxruntime wheel's.
        """
        if rec_batch_size < 1:
            raise ValueError("rec_batch_size must be >= 1")
        if not 0.0 <= text_score <= 1.0:
            raise ValueError("text_score must be within [0, 1]")
        if intra_op_threads is not None and intra_op_threads < 1:
            raise ValueError("intra_op_threads must be >= 1 or None")
        self.rec_batch_size = rec_batch_size
        self.text_score = text_score
        self.intra_op_threads = intra_op_threads
        self.merge_gap = merge_gap
        self.box_thresh = box_thresh
        self.unclip_ratio = unclip_ratio
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._det: Any = None
        self._cls: Any = None
        self._rec: Any = None
        self._charset: list[str] = []

    # ---------------------------------------------------------------------------- lifecycle

    def model_paths(self) -> dict[str, Path]:
        root = self.model_dir if self.model_dir is not None else default_model_dir()
        return {stage: root / filename for stage, filename in MODEL_FILES.items()}

    def _stage_config(self, stage: str, path: Path) -> dict[str, Any]:
        """The config dict the library's stage classes read (the keys of its config.yaml)."""
        config: dict[str, Any] = {
            "model_path": str(path),
            "use_cuda": False,
            "use_dml": False,
            "intra_op_num_threads": self.intra_op_threads or -1,
            "inter_op_num_threads": -1,
        }
        if stage == "det":
            config.update(
                limit_side_len=DET_LIMIT_SIDE_LEN,
                limit_type="min",
                mean=[0.5, 0.5, 0.5],
                std=[0.5, 0.5, 0.5],
                thresh=0.3,
                box_thresh=self.box_thresh,
                max_candidates=1000,
                unclip_ratio=self.unclip_ratio,
                use_dilation=True,
                score_mode="fast",
            )
        elif stage == "cls":
            config.update(
                cls_image_shape=[3, 48, 192],
                cls_batch_num=self.rec_batch_size,
                cls_thresh=0.9,
                label_list=["0", "180"],
            )
        else:
            config.update(
                rec_img_shape=[3, REC_HEIGHT, REC_MIN_WIDTH], rec_batch_num=self.rec_batch_size
            )
        return config

    def load(self) -> None:
        """Create the three onnxruntime sessions; fail clearly when a model file is missing."""
        if self._rec is not None:
            return
        paths = self.model_paths()
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise RuntimeError(
                f"engine 'rapid' cannot start, model file(s) missing: {', '.join(missing)} "
                "(they ship inside the rapidocr-onnxruntime==1.4.4 wheel: reinstall it)"
            )
        try:
            from rapidocr_onnxruntime.ch_ppocr_cls import TextClassifier
            from rapidocr_onnxruntime.ch_ppocr_det import TextDetector
            from rapidocr_onnxruntime.ch_ppocr_rec import TextRecognizer
        except ImportError as exc:
            raise RuntimeError(
                "engine 'rapid' needs rapidocr-onnxruntime==1.4.4: pip install 'ocrq[cpu]'"
            ) from exc
        try:
            det = TextDetector(self._stage_config("det", paths["det"]))
            cls = TextClassifier(self._stage_config("cls", paths["cls"]))
            rec = TextRecognizer(self._stage_config("rec", paths["rec"]))
        except Exception as exc:
            raise RuntimeError(f"engine 'rapid' could not load its ONNX models: {exc}") from exc
        self._det, self._cls, self._rec = det, cls, rec
        self._charset = list(rec.postprocess_op.character)

    def close(self) -> None:
        self._det = self._cls = self._rec = None

    def describe(self) -> dict[str, str]:
        """Facts that key a tuning profile: models, runtime, and the resize limits."""
        import onnxruntime

        return {
            "engine": self.name,
            "det_model": MODEL_FILES["det"],
            "cls_model": MODEL_FILES["cls"],
            "rec_model": MODEL_FILES["rec"],
            "onnxruntime": onnxruntime.__version__,
            "rapidocr_onnxruntime": metadata.version("rapidocr-onnxruntime"),
            "max_side_len": str(MAX_SIDE_LEN),
            "det_limit_side_len": str(DET_LIMIT_SIDE_LEN),
        }

    # ---------------------------------------------------------------------------- planning

    def estimate(self, item: PreparedImage) -> ItemCost:
        """An image's host-memory cost: its detector input pixels drive it (see cost_model)."""
        try:
            det_w, det_h = det_plan(*item.size).det_input
        except ValueError:
            det_w = det_h = 0
        pixels = det_w * det_h
        return ItemCost(tokens=0, patches=math.ceil(pixels / 1024), pixels=pixels)

    def cost_model(self) -> CostModel:
        """Peak host RSS = loaded process + one run's workspace + 64 KiB per detector patch.

        Measured on the 2-core CI VM (AMD EPYC, onnxruntime 1.32, the library's session options:
        CPU arena off, so freed activations go back to the OS between calls). Each probe in a
        fresh process: load, `reset_peak_memory()`, one `run()` of real eval images, then
        `peak_memory_bytes()` (VmHWM) minus the RSS at the reset. The images were decoded before
        the reset, so their pixels are not in the growth.

            process RSS with the engine loaded     181-183 MiB (the three sessions: 79-81 MiB)
            probe (images)                patches  peak growth  predicted growth
            SVT word crops x32              1,977    163 MiB      636 MiB
            SVT word crops x128             6,584    259 MiB      924 MiB
            receipt 522x954 x1                966    265 MiB      572 MiB
            receipt 522x954 x8              7,728    504 MiB      995 MiB
            dense text page 1240x1754 x1    2,145    465 MiB      646 MiB  (47 lines of 83 chars)
            dense text page 1240x1754 x4    8,580    589 MiB    1,048 MiB
            4 + 4 receipts ~600-900 wide   12,512    550 MiB    1,294 MiB
            page 3312x2550 (bilevel) x1     2,976    509 MiB      698 MiB
            receipt 4961x7016 x1            2,728    624 MiB      682 MiB
            receipt 4961x7016 x2            5,456    739 MiB      853 MiB
            2 x 4961x7016 + 6 receipts     14,688    633 MiB    1,430 MiB

        Growth is mostly a per-run workspace (the detector's activations for the largest image,
        a full-resolution BGR copy of it, one recogniser call bounded by REC_MAX_CALL_COLUMNS),
        growing slowly with the batch. The line 512 MiB + 64 KiB/patch lies above every probe
        (closest: one 4961x7016 receipt, 9% over) and over-predicts large batches of small
        images, which is the safe side. `ocrq tune` refits it on the host.
        """
        return CostModel(
            fixed_bytes=LOADED_RSS_BYTES + RUN_WORKSPACE_BYTES, per_patch_bytes=PER_PATCH_BYTES
        )

    # ---------------------------------------------------------------------------- running

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        """OCR a batch: detect per image, then classify and recognise all crops together."""
        if self._rec is None:
            raise RuntimeError("engine 'rapid' is not loaded; call load() first")
        results: list[OcrResult | Exception | None] = [None] * len(batch)
        pieces: dict[int, list[_Piece]] = {}
        for i, item in enumerate(batch):
            if item.task not in SUPPORTED_TASKS:
                results[i] = unsupported_task(item.task)
                continue
            try:
                pieces[i] = self._regions(item)
            except MemoryError:
                raise
            except Exception as exc:
                results[i] = exc
        for i, exc in self._read_all(pieces).items():
            results[i] = exc
            del pieces[i]
        for i, item_pieces in pieces.items():
            try:
                results[i] = self._assemble(batch[i], item_pieces)
            except Exception as exc:
                results[i] = exc
        lost = RuntimeError("engine 'rapid' lost this image's result")
        return [r if r is not None else lost for r in results]

    def _regions(self, item: PreparedImage) -> list[_Piece]:
        """The regions of one image to read: detected lines, or the whole image as one line."""
        img = to_bgr(item.image)
        h, w = img.shape[:2]
        plan = det_plan(w, h)
        quads = self._detect(img, plan)
        boxes = [_aabb(q) for q in quads]
        if not quads or (plan.line_candidate and len(group_rows(boxes)) < 2):
            # Read the whole image; its box is where the detector saw text, if anywhere.
            box = _union(boxes) if boxes else (0.0, 0.0, float(w), float(h))
            return [_Piece(box=box, crop=widen(upright(img)), whole=True)]
        return [
            _Piece(box=box, crop=crop_quad(img, q), whole=False)
            for q, box in zip(quads, boxes, strict=True)
        ]

    def _detect(self, img: np.ndarray, plan: DetPlan) -> list[np.ndarray]:
        """Detector quads (tl, tr, br, bl) in the pixels of `img`, clipped to it."""
        h, w = img.shape[:2]
        canvas = img if plan.resized == (w, h) else cv2.resize(img, plan.resized)
        px, py = plan.pad
        if px or py:
            border = cv2.BORDER_REPLICATE if plan.line_candidate else cv2.BORDER_CONSTANT
            canvas = cv2.copyMakeBorder(canvas, py, py, px, px, border, value=(0, 0, 0))
        net_in = cv2.resize(canvas, plan.det_input).astype(np.float32)
        net_in = ((net_in / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[np.newaxis]
        probs = self._det.infer(np.ascontiguousarray(net_in))[0]
        canvas_hw = canvas.shape[:2]
        boxes, _ = self._det.postprocess_op(probs, canvas_hw)
        boxes = self._det.filter_tag_det_res(boxes, canvas_hw) if len(boxes) else []
        rx, ry = w / plan.resized[0], h / plan.resized[1]
        quads = []
        for box in boxes:
            quad = np.asarray(box, dtype=np.float32).copy()
            quad[:, 0] = np.clip((quad[:, 0] - px) * rx, 0, w)
            quad[:, 1] = np.clip((quad[:, 1] - py) * ry, 0, h)
            if np.ptp(quad[:, 0]) >= 2 and np.ptp(quad[:, 1]) >= 2:
                quads.append(quad)
        return quads

    def _read_all(self, pieces: dict[int, list[_Piece]]) -> dict[int, Exception]:
        """Classify and recognise the crops of every image in shared calls.

        Should a shared call fail, each image's crops are read alone so the failure lands on the
        image that caused it; those exceptions come back by item index.
        """
        try:
            self._read([p for item_pieces in pieces.values() for p in item_pieces])
            return {}
        except MemoryError:
            raise
        except Exception:
            failed: dict[int, Exception] = {}
            for i, item_pieces in pieces.items():
                try:
                    self._read(item_pieces)
                except MemoryError:
                    raise
                except Exception as exc:
                    failed[i] = exc
            return failed

    def _read(self, pieces: list[_Piece]) -> None:
        """Turn upside-down detected lines over, then recognise every crop in batches.

        Works on copies of the crops and only sets text and score, so reading the same pieces
        again (after a shared call failed) starts from the same pixels.
        """
        crops = [p.crop for p in pieces]
        detected = [k for k, p in enumerate(pieces) if not p.whole]
        if detected:
            turned, _, _ = self._cls([crops[k] for k in detected])
            for k, crop in zip(detected, turned, strict=True):
                crops[k] = crop
        crops = [shrink_to_rec_height(c) for c in crops]
        for width, chunk in self._chunks(crops):
            readings = self._recognise([crops[k] for k in chunk], width)
            for k, (text, score) in zip(chunk, readings, strict=True):
                pieces[k].text, pieces[k].score = text, score

    def _chunks(self, crops: list[np.ndarray]) -> list[tuple[int, list[int]]]:
        """Recogniser calls as (padded width, crop indices): crops of one `rec_input_width`, up
        to rec_batch_size of them and at most REC_MAX_CALL_COLUMNS columns in all, which bounds
        a call's memory."""
        by_width: dict[int, list[int]] = {}
        for k, crop in enumerate(crops):
            by_width.setdefault(rec_input_width(crop), []).append(k)
        chunks = []
        for width in sorted(by_width):
            group = by_width[width]
            size = max(1, min(self.rec_batch_size, REC_MAX_CALL_COLUMNS // width))
            chunks += [(width, group[i : i + size]) for i in range(0, len(group), size)]
        return chunks

    def _recognise(self, crops: list[np.ndarray], width: int) -> list[tuple[str, float]]:
        """One recogniser call on crops that share the padded input width `width`."""
        probs = self._rec.session(np.stack([rec_input(c, width) for c in crops]))[0]
        step = width / probs.shape[1]  # input pixels per output step
        readings = []
        for crop, crop_probs in zip(crops, probs, strict=True):
            h, w = crop.shape[:2]
            content_w = min(math.ceil(REC_HEIGHT * w / h), width)
            readings.append(self._decode(crop_probs, step * w / content_w, word_gaps(crop)))
        return readings

    def _decode(self, probs: np.ndarray, x_scale: float, gaps: list[float]) -> tuple[str, float]:
        """Greedy CTC decoding, plus a space wherever a word gap lies between two characters.

        The score is the library's: the mean probability of the emitted steps. Each emitted
        character sits at step t, i.e. at x = (t + 0.5) * x_scale in the crop.
        """
        best = probs.argmax(axis=1)
        emitted = np.flatnonzero((best != 0) & (best != np.concatenate(([0], best[:-1]))))
        if emitted.size == 0:
            return "", 0.0
        score = float(probs[emitted, best[emitted]].mean())
        chars = [self._charset[k] for k in best[emitted]]
        xs = (emitted + 0.5) * x_scale
        out = [chars[0]]
        for k in range(1, len(chars)):
            prev, ch = chars[k - 1], chars[k]
            spaced = prev == " " or ch == " " or is_wide_char(prev) or is_wide_char(ch)
            if not spaced and any(xs[k - 1] < gx < xs[k] for gx in gaps):
                out.append(" ")
            out.append(ch)
        return " ".join("".join(out).split()), score

    def _assemble(self, item: PreparedImage, pieces: list[_Piece]) -> OcrResult:
        """Drop weak lines, order and merge, and express boxes in original-image pixels."""
        kept = [(p.text, p.box, p.score) for p in pieces if p.text and p.score >= self.text_score]
        sx, sy = item.scale_to_original()
        ow, oh = item.original_size
        lines = []
        for text, (x1, y1, x2, y2), score in merge_rows(kept, self.merge_gap):
            box = (
                _clamp(math.floor(x1 * sx), ow),
                _clamp(math.floor(y1 * sy), oh),
                _clamp(math.ceil(x2 * sx), ow),
                _clamp(math.ceil(y2 * sy), oh),
            )
            lines.append(Line(text=text, box=box, score=score))
        return OcrResult(text="\n".join(line.text for line in lines), lines=lines)


def _aabb(quad: np.ndarray) -> Box:
    return (
        float(quad[:, 0].min()),
        float(quad[:, 1].min()),
        float(quad[:, 0].max()),
        float(quad[:, 1].max()),
    )


def _union(boxes: Sequence[Box]) -> Box:
    return (
        min(b[0] for b in boxes),
        min(b[1] for b in boxes),
        max(b[2] for b in boxes),
        max(b[3] for b in boxes),
    )


def _clamp(value: int, limit: int) -> int:
    return min(max(value, 0), limit)
