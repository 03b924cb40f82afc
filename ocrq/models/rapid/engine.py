"""RapidEngine: detection per image, then the crops of a whole batch through the classifier and
the recogniser together (the package docstring lists the departures from the library)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from itertools import pairwise
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from ocrq.core.contract import TASKS
from ocrq.models.base import Engine, Line, OcrResult, PreparedImage, UnsupportedTask
from ocrq.models.costs import CostModel, ItemCost
from ocrq.models.rapid.crops import (
    REC_HEIGHT,
    REC_MIN_WIDTH,
    crop_quad,
    rec_input,
    rec_input_width,
    reduce_short_side,
    shrink_to_rec_height,
    to_bgr,
    upright,
    widen,
)
from ocrq.models.rapid.geometry import DET_LIMIT_SIDE_LEN, MAX_SIDE_LEN, DetPlan, det_plan
from ocrq.models.rapid.models import ModelSet, model_set, sha256_of
from ocrq.models.rapid.ordering import Box, group_rows, gutter_cuts, read_blocks, union
from ocrq.models.rapid.punctuation import fold_latin
from ocrq.models.rapid.spacing import WordGaps, word_gaps
from ocrq.models.rapid.tiles import (
    REC_TILE_COLUMNS,
    Reading,
    Tile,
    check_line,
    line_columns,
    stitch,
    tiles,
)

SUPPORTED_TASKS = ("text", "spotting", "parse")

# The direction classifier's threshold (the library's), and how it judges a long line.
CLS_THRESH = 0.9
CLS_WINDOW_RATIO = 8
CLS_MAX_WINDOWS = 8
# A part of a box cut at a column gutter narrower than this many times its height is dropped.
SLIVER_WIDTH = 0.75
# A recogniser call holds at most this many padded columns (see crops.REC_WIDTH_STEP).
REC_MAX_CALL_COLUMNS = 15_360

# Host-memory model (see `cost_model()` for how it was measured): the loaded process, one run's
# workspace and the detector's bytes per input pixel are the model set's (`models.ModelSet`);
# the bytes per pixel of the image itself are the pipeline's, in `estimate`.
IMAGE_BYTES_PER_PIXEL = 8


def unsupported_task(task: str) -> UnsupportedTask:
    """The per-item error for a task this engine cannot do, naming the engine that can."""
    what = f"task {task!r}" if task in TASKS else "free prompts"
    return UnsupportedTask(
        f"engine 'rapid' supports tasks {', '.join(SUPPORTED_TASKS)}; "
        f"use --engine hunyuan for {what}"
    )


@dataclass
class _Piece:
    """One region of one image: its box in image pixels, its crop, and then its reading."""

    box: Box
    crop: np.ndarray
    whole: bool  # the whole image read as one line: no direction classifier, widened
    stretch: float = 1.0  # how much the crop was widened (word gaps are judged without it)
    text: str = ""
    score: float = 0.0


class RapidEngine(Engine):
    """PP-OCR detection, direction classifier and recognition on onnxruntime (CPU)."""

    name = "rapid"

    def __init__(
        self,
        rec_batch_size: int = 16,
        text_score: float = 0.5,
        intra_op_threads: int | None = None,
        merge_gap: float = 0.3,
        box_thresh: float = 0.5,
        unclip_ratio: float | None = None,
        model_dir: Path | None = None,
        latin_punctuation: bool = True,
        models: str = "",
    ) -> None:
        """
        rec_batch_size: crops per classifier/recogniser call, across all images of a batch.
        text_score: lines read with a lower mean character confidence are dropped.
        intra_op_threads: onnxruntime threads per session; None lets onnxruntime decide (one per
            physical core), right unless several engines share the host.
        merge_gap: boxes on one row closer than this many line heights become one Line.
        box_thresh, unclip_ratio: the DB detector's box score floor and box growth (None: the
            model set's, `models.ModelSet.unclip_ratio`).
        model_dir: where the three .onnx files are; default the rapidocr-onnxruntime wheel's.
        latin_punctuation: fold Chinese punctuation in Latin text to ASCII (`punctuation`).
        model_dir: a folder holding the set's three .onnx files under their own names, in place
            of the wheels that ship them (their hashes are then not checked).
        models: the model set (`models.MODEL_SETS`, OCRQ_RAPID_MODELS); empty: the default.
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
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.latin_punctuation = latin_punctuation
        self.models: ModelSet = model_set(models)  # an unknown name fails here, at start-up
        self.unclip_ratio = self.models.unclip_ratio if unclip_ratio is None else unclip_ratio
        self._det: Any = None
        self._cls: Any = None
        self._rec: Any = None
        self._charset: list[str] = []

    # ---------------------------------------------------------------------------- lifecycle

    def model_paths(self) -> dict[str, Path]:
        files = self.models.files()
        if self.model_dir is not None:
            return {stage: self.model_dir / f.name for stage, f in files.items()}
        return {stage: f.locate() for stage, f in files.items()}

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
                mean=list(self.models.det_mean),
                std=list(self.models.det_std),
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
                cls_thresh=CLS_THRESH,
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
            wheels = sorted({f.requirement for f in self.models.files().values()})
            raise RuntimeError(
                f"engine 'rapid' cannot start, model file(s) of set {self.models.name!r} "
                f"missing: {', '.join(missing)} (they ship inside {' and '.join(wheels)}: "
                "reinstall)"
            )
        if self.model_dir is None:
            for stage, f in self.models.files().items():
                if sha256_of(paths[stage]) != f.sha256:
                    raise RuntimeError(
                        f"engine 'rapid' cannot start: {paths[stage]} is not the file "
                        f"{f.requirement} ships (SHA-256 differs): reinstall it"
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
            "models": self.models.name,
            "det_model": self.models.det.name,
            "cls_model": self.models.cls.name,
            "rec_model": self.models.rec.name,
            "onnxruntime": onnxruntime.__version__,
            "rapidocr_onnxruntime": metadata.version("rapidocr-onnxruntime"),
            "max_side_len": str(MAX_SIDE_LEN),
            "det_limit_side_len": str(DET_LIMIT_SIDE_LEN),
        }

    # ---------------------------------------------------------------------------- planning

    def estimate(self, item: PreparedImage) -> ItemCost:
        """An image's host-memory cost beyond the run's workspace (see `cost_model`).

        `pixels` is the detector's input; `patches` counts KiB: the set's det_bytes_per_pixel per
        detector input pixel and IMAGE_BYTES_PER_PIXEL per pixel of the image itself (its BGR
        copy, the crops cut from it at full resolution, the lines held until the recogniser has
        read them).
        """
        w, h = item.size
        try:
            det_w, det_h = det_plan(w, h).det_input
        except ValueError:
            return ItemCost(tokens=0, patches=0, pixels=0)
        pixels = det_w * det_h
        work = self.models.det_bytes_per_pixel * pixels + IMAGE_BYTES_PER_PIXEL * w * h
        return ItemCost(tokens=0, patches=math.ceil(work / 1024), pixels=pixels)

    def cost_model(self) -> CostModel:
        """Peak host RSS = loaded process + one run's workspace + the images' own terms.

        Measured with bench/rapid_memory.py for each model set (results in
        bench/results/rapid_memory/rapid_memory_cpu_<set>.md; the figures below are v4's, and
        `models.py` says how v6's differ): each case in a fresh process, engine loaded
        and images decoded, then VmHWM growth over one `run()` (onnxruntime with the library's
        session options: CPU arena off, so freed activations go back to the OS between calls). The
        images' decoded pixels are outside it: the worker's prefetch holds them whatever the engine
        does.

        The largest part is the detector's activations, about 160 bytes per input pixel (666 MiB
        at its 4 MP cap, measured alone). Images are detected one after the other, so that is a
        per-run maximum, not a per-image sum: the set's run_workspace_bytes covers one detection
        at the cap and one recogniser call (at most REC_MAX_CALL_COLUMNS columns: 320 MiB), with
        room for what the allocator still holds, which varies from run to run with onnxruntime's
        thread timing: on the loaded 2-core CI VM the same 13340x124 line grew by 620 MiB in most
        runs and by 710-760 MiB in about one in five, which the 720 MiB workspace used before
        covered by only 1.03x. What grows with the batch is per image: the BGR copy and
        full-resolution crops while it is cut up, and its lines until they are read. Single
        images grew by 140-930 MiB (a 40 MP 400x100000 page the most) and were predicted at
        least 1.25x that (that line in a 720 MiB run; pages 1.32-1.8x, small strips 3.2-3.7x);
        batches (8 receipts, 4 A4 pages, 8 40 MP pages, 125 word crops) 1.8-4.7x, the safe side.
        The estimate by detector pixels alone (512 MiB + 64 KiB per 1024) had predicted
        0.84-0.96 of what a 40 MP page or a 4961x7016 receipt took.
        `ocrq tune` refits it on the host.
        """
        fixed = self.models.loaded_rss_bytes + self.models.run_workspace_bytes
        return CostModel(fixed_bytes=fixed, per_patch_bytes=1024.0)

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
        """The regions of one image to read: detected lines, or the whole image as one line.

        Crops are brought down to the recogniser's height as they are cut, so a batch of large
        pages never holds its lines at full resolution. A region too long to read is refused
        here, before any recogniser work (`tiles.check_line`).
        """
        img = to_bgr(item.image)
        h, w = img.shape[:2]
        plan = det_plan(w, h)
        quads = _cut_at_gutters(self._detect(img, plan))
        boxes = [_aabb(q) for q in quads]
        one_row = plan.line_candidate and len(group_rows(boxes)) < 2
        if not quads or (one_row and not _longer_than_a_tile(w, h)):
            # Read the whole image; its box is where the detector saw text, if anywhere.
            box = union(boxes) if boxes else (0.0, 0.0, float(w), float(h))
            if not plan.line_candidate:  # a page with nothing found: no need for its pixels
                img = reduce_short_side(img, 2 * REC_HEIGHT)
            turned = upright(img)
            crop = widen(turned, self.models.widen_max)
            stretch = crop.shape[1] / turned.shape[1]
            pieces = [_Piece(box, shrink_to_rec_height(crop), whole=True, stretch=stretch)]
        else:
            pieces = [
                _Piece(box=box, crop=shrink_to_rec_height(crop_quad(img, q)), whole=False)
                for q, box in zip(quads, boxes, strict=True)
            ]
        for piece in pieces:
            ch, cw = piece.crop.shape[:2]
            check_line(cw, ch, "the whole image" if piece.whole else "a text region")
        return pieces

    def _detect(self, img: np.ndarray, plan: DetPlan) -> list[np.ndarray]:
        """Detector quads (tl, tr, br, bl) in the pixels of `img`, clipped to it."""
        h, w = img.shape[:2]
        canvas = img if plan.resized == (w, h) else cv2.resize(img, plan.resized)
        px, py = plan.pad
        if px or py:
            border = cv2.BORDER_REPLICATE if plan.line_candidate else cv2.BORDER_CONSTANT
            canvas = cv2.copyMakeBorder(canvas, py, py, px, px, border, value=(0, 0, 0))
        net_in = cv2.resize(canvas, plan.det_input).astype(np.float32)
        # In place, (x / 255 - mean) / std as x * scale + shift, without three temporaries.
        std, mean = np.asarray(self.models.det_std), np.asarray(self.models.det_mean)
        net_in *= (1.0 / (255.0 * std)).astype(np.float32)
        net_in += (-mean / std).astype(np.float32)
        probs = self._det.infer(np.ascontiguousarray(net_in.transpose(2, 0, 1)[np.newaxis]))[0]
        del net_in
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
            self._read(list(pieces.values()))
            return {}
        except MemoryError:
            raise
        except Exception:
            failed: dict[int, Exception] = {}
            for i, item_pieces in pieces.items():
                try:
                    self._read([item_pieces])
                except MemoryError:
                    raise
                except Exception as exc:
                    failed[i] = exc
            return failed

    def _read(self, images: list[list[_Piece]]) -> None:
        """Turn the detected lines of upside-down images over, then recognise every crop, in
        tiles where it is longer than one (see `tiles`), in batched calls.

        An image is upside down when most of its detected lines are (`_upside_down`), and then
        all of them are turned; lines are never turned one by one. The classifier called 20 of
        the ~1,100 upright lines of the 20 SROIE receipts upside down (a price, a short code),
        which then read as noise: SROIE token F1 0.875 -> 0.885 taking the image's majority
        (no receipt worse), scene word recall 0.719 -> 0.750; a page or receipt scanned upside
        down is still turned whole. Works on copies of the crops and only sets text and score,
        so reading the same pieces again (after a shared call failed) starts from the same
        pixels.
        """
        pieces = [p for image in images for p in image]
        owner = [n for n, image in enumerate(images) for _ in image]
        crops = [p.crop for p in pieces]
        detected = [k for k, p in enumerate(pieces) if not p.whole]
        votes = self._upside_down([crops[k] for k in detected])
        lines, turned = [0] * len(images), [0] * len(images)
        for k, flip in zip(detected, votes, strict=True):
            lines[owner[k]] += 1
            turned[owner[k]] += flip
        for k in detected:
            if 2 * turned[owner[k]] > lines[owner[k]]:
                crops[k] = cv2.rotate(crops[k], cv2.ROTATE_180)
        parts = [(k, tile) for k, crop in enumerate(crops) for tile in tiles(crop)]
        inputs = [crops[k][:, tile.start : tile.stop] for k, tile in parts]
        readings: list[Reading] = [Reading()] * len(parts)
        for width, chunk in self._chunks(inputs):
            for j, reading in zip(
                chunk, self._recognise([inputs[j] for j in chunk], width), strict=True
            ):
                readings[j] = reading
        del inputs
        by_piece: dict[int, list[tuple[Tile, Reading]]] = {}
        for (k, tile), reading in zip(parts, readings, strict=True):
            by_piece.setdefault(k, []).append((tile, reading))
        for k, piece in enumerate(pieces):
            whole = stitch(by_piece[k])
            gaps = word_gaps(crops[k], piece.stretch) if self.models.word_gaps else WordGaps()
            piece.text = gaps.join(whole.chars, whole.xs)
            piece.score = float(whole.probs.mean()) if whole.chars else 0.0

    def _upside_down(self, crops: list[np.ndarray]) -> list[bool]:
        """Which crops the direction classifier finds upside down.

        The classifier squeezes its input into 192x48: fine for a line of a receipt, but a line
        longer than a recogniser tile came out as noise (a 13270x44 line: "180" at 0.97). Such a
        crop is judged by up to CLS_MAX_WINDOWS windows of CLS_WINDOW_RATIO x its height spread
        along it, turned when more windows say "180" than "0" with the library's confidence
        (windows of 24 x the height were squeezed too: 5 windows of a turned 26667x48 strip voted
        2-3 with scores of 0.67-0.91; at 8 x all five said "180" at 0.95-1.0). A crop within one
        tile is one window, which is the library's rule.
        """
        if not crops:
            return []
        windows: list[np.ndarray] = []
        owners: list[int] = []
        for k, crop in enumerate(crops):
            h, w = crop.shape[:2]
            span = CLS_WINDOW_RATIO * h
            if line_columns(w, h) <= REC_TILE_COLUMNS:
                starts = [0]
                span = w
            else:
                count = min(CLS_MAX_WINDOWS, math.ceil(w / span))
                starts = [round(x) for x in np.linspace(0, w - span, count)]
            windows += [crop[:, x : x + span] for x in starts]
            owners += [k] * len(starts)
        _, labels, _ = self._cls(windows)
        votes = [0] * len(crops)
        for k, (label, score) in zip(owners, labels, strict=True):
            if score > CLS_THRESH:  # an unsure window (a blank stretch, say) does not vote
                votes[k] += 1 if "180" in label else -1
        return [v > 0 for v in votes]

    def _chunks(self, crops: list[np.ndarray]) -> list[tuple[int, list[int]]]:
        """Recogniser calls as (padded width, crop indices): crops of one `rec_input_width`, up
        to rec_batch_size of them and at most REC_MAX_CALL_COLUMNS columns in all, which bounds
        a call's memory."""
        by_width: dict[int, list[int]] = {}
        for k, crop in enumerate(crops):
            by_width.setdefault(rec_input_width(crop, self.models.rec_min_width), []).append(k)
        chunks = []
        for width in sorted(by_width):
            group = by_width[width]
            size = max(1, min(self.rec_batch_size, REC_MAX_CALL_COLUMNS // width))
            chunks += [(width, group[i : i + size]) for i in range(0, len(group), size)]
        return chunks

    def _recognise(self, crops: list[np.ndarray], width: int) -> list[Reading]:
        """One recogniser call on crops that share the padded input width `width`."""
        probs = self._rec.session(np.stack([rec_input(c, width) for c in crops]))[0]
        step = width / probs.shape[1]  # input pixels per output step
        readings = []
        for crop, crop_probs in zip(crops, probs, strict=True):
            h, w = crop.shape[:2]
            content_w = min(math.ceil(REC_HEIGHT * w / h), width)
            readings.append(self._decode(crop_probs, step * w / content_w))
        return readings

    def _decode(self, probs: np.ndarray, x_scale: float) -> Reading:
        """Greedy CTC decoding: the characters, each at x = (t + 0.5) * x_scale in the crop for
        the step t that emitted it, with that step's probability (their mean is the library's
        score)."""
        best = probs.argmax(axis=1)
        emitted = np.flatnonzero((best != 0) & (best != np.concatenate(([0], best[:-1]))))
        return Reading(
            chars=[self._charset[k] for k in best[emitted]],
            xs=(emitted + 0.5) * x_scale,
            probs=probs[emitted, best[emitted]].astype(np.float64),
        )

    def _assemble(self, item: PreparedImage, pieces: list[_Piece]) -> OcrResult:
        """Drop weak lines, order and merge, and express boxes in original-image pixels.

        The text is the lines in reading order, a blank line between blocks (`ordering`).
        """
        kept = [(p.text, p.box, p.score) for p in pieces if p.text and p.score >= self.text_score]
        sx, sy = item.scale_to_original()
        ow, oh = item.original_size
        blocks: list[list[Line]] = []
        for block in read_blocks(kept, self.merge_gap):
            blocks.append([])
            for text, (x1, y1, x2, y2), score in block:
                box = (
                    _clamp(math.floor(x1 * sx), ow),
                    _clamp(math.floor(y1 * sy), oh),
                    _clamp(math.ceil(x2 * sx), ow),
                    _clamp(math.ceil(y2 * sy), oh),
                )
                if self.latin_punctuation:
                    text = fold_latin(text)
                blocks[-1].append(Line(text=text, box=box, score=score))
        text = "\n\n".join("\n".join(line.text for line in block) for block in blocks)
        return OcrResult(text=text, lines=[line for block in blocks for line in block])

    def preferred_max_batch(self) -> int:
        """4, not the base class's 32: a batch's results reach the store only when the whole
        batch ends, and on the CPU a bigger batch buys nothing. Images are detected one at a
        time and a receipt's own lines fill the recogniser's calls, so batches of 1, 2 and 4
        SROIE receipts ran at the same CPU-s per image within noise (11.4, 11.2, 11.1; wall
        26.2, 27.0, 27.3 s per image on a loaded host: bench/results/rapid_batch_size/), while
        batches of 32 showed 19 receipts no progress for 125 s, then all at once (issue 52).
        4 rather than 1: `ocrq tune --images` sweeps 1, 2, 4 up to it and needs two settings to
        name a knee."""
        return 4


def _longer_than_a_tile(w: int, h: int) -> bool:
    """Whether a w x h image read whole (turned upright first) needs more than one tile."""
    if h / w >= 1.5:
        w, h = h, w
    return line_columns(w, h) > REC_TILE_COLUMNS


def _cut_at_gutters(quads: list[np.ndarray]) -> list[np.ndarray]:
    """The detector's quads with those that cross a column gutter cut there (`gutter_cuts`), so
    each part is read with its own column. A part narrower than SLIVER_WIDTH x its height is
    dropped: the end of a line that ran a letter or two into the next column, whose own box
    holds that text."""
    cuts = gutter_cuts([_aabb(q) for q in quads])
    if not cuts:
        return quads
    out = []
    for k, quad in enumerate(quads):
        if k not in cuts:
            out.append(quad)
            continue
        tl, tr, br, bl = quad
        x0, x1 = float(quad[:, 0].min()), float(quad[:, 0].max())
        stops = [0.0, *((x - x0) / (x1 - x0) for x in cuts[k]), 1.0]
        for a, b in pairwise(stops):
            part = np.array(
                [tl + (tr - tl) * a, tl + (tr - tl) * b, bl + (br - bl) * b, bl + (br - bl) * a],
                dtype=np.float32,
            )
            if np.ptp(part[:, 0]) >= SLIVER_WIDTH * np.ptp(part[:, 1]):
                out.append(part)
    return out


def _aabb(quad: np.ndarray) -> Box:
    return (
        float(quad[:, 0].min()),
        float(quad[:, 1].min()),
        float(quad[:, 0].max()),
        float(quad[:, 1].max()),
    )


def _clamp(value: int, limit: int) -> int:
    return min(max(value, 0), limit)
