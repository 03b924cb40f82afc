"""Where the detector looks: the input size and padding for one image, from its size alone.

Shared by `RapidEngine.estimate` and `RapidEngine.run`, so the pixels the planner counts are the
pixels that run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The library's resize limits (rapidocr_onnxruntime/config.yaml): a page is first brought to a long
# side <= MAX_SIDE_LEN, then the detector upscales it until its SHORT side is >= DET_LIMIT_SIDE_LEN.
MAX_SIDE_LEN = 2000
MIN_SIDE_LEN = 30
DET_LIMIT_SIDE_LEN = 736
LETTERBOX_MIN_HEIGHT = 30
LETTERBOX_MAX_RATIO = 8
# Possible word/line crops: shorter side <= LINE_MAX_SIDE (SVT word crops are 17..247 px tall).
# They are detected unscaled, on a canvas padded by LINE_PAD x their shorter side, capped at
# LINE_DET_MAX_SIDE. Measured on the 125 SVT crops: 0.56 word accuracy when detected like pages
# with a whole-image fallback, 0.89 when read whole, 0 of them found to hold two rows this way.
LINE_MAX_SIDE = 256
LINE_PAD = 0.5
LINE_DET_MAX_SIDE = 960
# ... but a long strip is not shrunk below LINE_DET_MIN_SIDE on its short side to meet that cap:
# a 13340x124 text line squeezed to 960x32 held 3 px tall text, which the detector cannot see.
LINE_DET_MIN_SIDE = 256
# Whatever the image, the detector's input stays within DET_MAX_PIXELS and DET_MAX_SIDE: its
# activations grow with its input (about 64 bytes a pixel), and the library's min-side upscale
# alone would turn a 2000x100000 page into a 736x46000 input (34 MP). Every page the library
# would detect at most 2000x2000 (4 MP) is untouched.
DET_MAX_PIXELS = 2048 * 2048
DET_MAX_SIDE = 16_384


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


def _floor32(x: float) -> int:
    return max(32, int(x // 32) * 32)


def _cap_scale(cw: int, ch: int) -> float:
    """The largest scale at which a cw x ch canvas fits DET_MAX_PIXELS and DET_MAX_SIDE."""
    return min(math.sqrt(DET_MAX_PIXELS / (cw * ch)), DET_MAX_SIDE / max(cw, ch))


def _within_caps(size: tuple[int, int], cw: int, ch: int) -> tuple[int, int]:
    """`size` (a detector input for a cw x ch canvas), shrunk onto the caps if it exceeds them.

    Flooring to multiples of 32 keeps the result inside: a side floored to its 32 minimum leaves
    at most 32 x DET_MAX_SIDE pixels.
    """
    if size[0] * size[1] <= DET_MAX_PIXELS and max(size) <= DET_MAX_SIDE:
        return size
    scale = _cap_scale(cw, ch)
    return _floor32(cw * scale), _floor32(ch * scale)


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
    return DetPlan((w, h), (0, pad_y), _within_caps(det_input, cw, ch), False)


def _line_plan(w: int, h: int) -> DetPlan:
    """A small image at its own scale, padded so text touching its edges is still found.

    When the canvas must shrink (LINE_DET_MAX_SIDE, or the caps for a very long strip), the image
    is shrunk before it is padded, so no full-resolution padded copy of a long strip is made.
    """
    pad = int(LINE_PAD * min(w, h))
    cw, ch = w + 2 * pad, h + 2 * pad
    scale = max(
        min(1.0, LINE_DET_MAX_SIDE / max(cw, ch)), min(1.0, LINE_DET_MIN_SIDE / min(cw, ch))
    )
    scale = min(scale, _cap_scale(cw, ch))
    if scale < 1.0:
        w, h, pad = max(1, round(w * scale)), max(1, round(h * scale)), round(pad * scale)
        cw, ch = w + 2 * pad, h + 2 * pad
    det_input = _within_caps((_round32(cw), _round32(ch)), cw, ch)
    return DetPlan((w, h), (pad, pad), det_input, True)


def det_plan(w: int, h: int) -> DetPlan:
    """Detector geometry for a w x h image, computed without pixels.

    Shared by `estimate` and `run`, so the pixels the planner counts are the pixels that run.
    """
    if w <= 0 or h <= 0:
        raise ValueError(f"image of {w}x{h} pixels has nothing to read")
    return _line_plan(w, h) if min(w, h) <= LINE_MAX_SIDE else _page_plan(w, h)
