"""Pixels of one region on their way to the recogniser: cut, turned, shrunk, padded."""

from __future__ import annotations

import math

import cv2
import numpy as np
from PIL import Image

REC_HEIGHT = 48
REC_MIN_WIDTH = 320  # the recogniser input is at least this wide (the library's shape)
# A crop read whole that is narrower than WIDEN_TO_RATIO:1 is stretched horizontally (by at most
# the model set's cap, `models.ModelSet.widen_max`; WIDEN_MAX by default) before recognition: the
# recogniser emits one step per 8 input pixels, and short words in near-square crops got too
# few (PP-OCRv4, SVT crops read whole: 0.888 -> 0.912 in a sweep of the recogniser alone, flat
# for target ratios 2.5-3 and caps 1.25-2x).
WIDEN_TO_RATIO = 3.0
WIDEN_MAX = 1.5
# The recogniser's input width for a crop depends on that crop alone (its own width rounded up
# to REC_WIDTH_STEP), never on its batch-mates: what the model reads shifts with the padding, so
# padding to the widest crop of a call (as the library does) made results depend on the batch.
# Measured peak RSS growth of one call (batch x 48 x width): 16x320 95 MiB, 16x1920 315 MiB,
# 16x3840 540 MiB, 1x7680 148 MiB, so ~55 MiB + 8 KiB per padded column: a call holds at most
# REC_MAX_CALL_COLUMNS (16 crops of 960), about 180 MiB.
REC_WIDTH_STEP = 64
# OpenCV's remap (under warpPerspective) refuses outputs of SHRT_MAX columns or more: a detected
# box longer than CROP_MAX_SIDE is cut at a proportionally reduced scale.
CROP_MAX_SIDE = 32_000
BGR_BAND_ROWS = 256


def to_bgr(image: Image.Image) -> np.ndarray:
    """PIL image -> contiguous BGR uint8 array, the channel order the models were trained on.

    Converted in bands of BGR_BAND_ROWS rows: numpy reads a PIL image through `tobytes()`, so a
    whole-image conversion holds two full copies at once (227 MiB for a 40 MP page) besides the
    result; by bands it holds the result and one band (131 MiB), and is faster.
    """
    if image.mode != "RGB":
        image = image.convert("RGB")
    w, h = image.size
    if w == 0 or h == 0:
        raise ValueError(f"image has no pixels ({w}x{h})")
    out = np.empty((h, w, 3), dtype=np.uint8)
    for y in range(0, h, BGR_BAND_ROWS):
        band = np.asarray(image.crop((0, y, w, min(h, y + BGR_BAND_ROWS))))
        cv2.cvtColor(band, cv2.COLOR_RGB2BGR, dst=out[y : y + BGR_BAND_ROWS])
    return out


def reduce_short_side(img: np.ndarray, side: int) -> np.ndarray:
    """Shrink (area averaging) so the shorter side is at most `side`."""
    h, w = img.shape[:2]
    if min(h, w) <= side:
        return img
    k = side / min(h, w)
    return cv2.resize(
        img, (max(1, round(w * k)), max(1, round(h * k))), interpolation=cv2.INTER_AREA
    )


def crop_quad(img: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """Rectify the quadrilateral `quad` (tl, tr, br, bl) of `img` into an upright crop.

    A crop much taller than wide is turned a quarter so vertical text runs left to right, as the
    recogniser expects.
    """
    quad = quad.astype(np.float32)
    width = int(max(np.linalg.norm(quad[0] - quad[1]), np.linalg.norm(quad[2] - quad[3])))
    height = int(max(np.linalg.norm(quad[0] - quad[3]), np.linalg.norm(quad[1] - quad[2])))
    width, height = max(width, 1), max(height, 1)
    if max(width, height) > CROP_MAX_SIDE:
        scale = CROP_MAX_SIDE / max(width, height)
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
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


def widen(img: np.ndarray, max_factor: float = WIDEN_MAX) -> np.ndarray:
    """Stretch a narrow whole-image crop horizontally towards WIDEN_TO_RATIO:1, by at most
    `max_factor` (an upright crop is at most 1.5 times taller than wide, so a factor above
    4.5 never applies)."""
    h, w = img.shape[:2]
    factor = min(WIDEN_TO_RATIO * h / w, max_factor)
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


def rec_input_width(crop: np.ndarray, min_width: int = REC_MIN_WIDTH) -> int:
    """Padded recogniser input width for a crop: its width at REC_HEIGHT, rounded up to
    REC_WIDTH_STEP, at least `min_width` (the model set's; the library's narrowest input,
    REC_MIN_WIDTH, by default)."""
    h, w = crop.shape[:2]
    own = math.ceil(REC_HEIGHT * w / h)
    return max(min_width, math.ceil(own / REC_WIDTH_STEP) * REC_WIDTH_STEP)


def rec_input(crop: np.ndarray, width: int) -> np.ndarray:
    """The recogniser's input for one crop: REC_HEIGHT tall, scaled to [-1, 1], left-aligned and
    zero-padded (mid-grey once scaled) to `width` columns, as the model was trained."""
    h, w = crop.shape[:2]
    resized_w = min(width, math.ceil(REC_HEIGHT * w / h))
    resized = cv2.resize(crop, (resized_w, REC_HEIGHT)).astype(np.float32)
    out = np.zeros((3, REC_HEIGHT, width), dtype=np.float32)
    out[:, :, :resized_w] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return out
