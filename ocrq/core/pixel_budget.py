"""One image's pixel budget: every cap on its pixels under its own name, and the one question
each stage asks ("how many pixels may this image have here?").

Why one owner: four caps bound an image's pixels, set by four different parties, and they used
to travel under one name (`max_pixels`) through the producer, the worker, the engine and back,
so that an image could be downscaled at four points and a planner's shrink below the model's
floor was scaled back up by the processor. Here each cap has its name, and each stage reads
its answer from one function (`PixelBudget.at`), which never grows from one stage to the next:

* `intake_limit` (OCRQ_MAX_IMAGE_PIXELS): the intake's defence against decompression bombs. An
  image over it is refused from its header (ocrq/intake/images.py `check_header`), never resized;
* `job_cap` (the producer's `max_pixels`: api field, message kwarg, the row's column from
  migrations/0005): the most the job wants the model to see;
* `task_preset` (OCRQ_TASK_MAX_PIXELS, else the engine's preset for the task,
  ocrq/models/hunyuan/resolution.py): what the model sees when the job sets no cap;
* `fit_cap`: the planner's downscale-to-fit of one image too big for the memory budget alone
  (ocrq/scheduling/planner.py `_shrink`, made by ocrq/scheduling/downscaling.py), set per round.

The model's own range (`model_floor`..`model_limit`, its processor's limits) is not a cap that
anyone chooses; it bounds the others: a cap above the limit means the limit, a cap below the
floor means the floor (the processor scales a smaller image up to it anyway, so shrinking past it
would scale the image down and then up again).

The stages, in the order an image passes them (each answer at most the one before):

* `DECODE` (intake, the prefetch thread): a decoded image or a drawn page keeps at most the
  model's limit while it waits. Not the model's view: the engine's fit makes the exact size the
  model sees (a multiple of its patch grid) from the decoded pixels in one resize;
* `RENDER` (intake): a document page is drawn at the model's view, so it is drawn at about the
  size the model sees instead of drawn large and shrunk (the render DPI follows it);
* `MODEL` (the engine's `estimate`, `prepare` and `run`): the pixels the model sees;
* `FIT` (the planner's downscaler): the size a too-big image is shrunk to, never below the floor.

No stage grows an image: the one raise of an image under the model's floor is the processor's
own resize, last (the engine's fit keeps such an image as it is; the fit stage's copies are never
under the floor). A stage that raised one (the engine's fit of 48x96 under a cap at the floor
made it 64x96) handed the next an image over its cap, which that one shrank again (52x78).

An engine without a view of its own (no `model_limit`: the CPU engine, which reads crops of the
image as handed in) has no model stage: its budget answers None (keep) at every stage but `FIT`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum


class Stage(StrEnum):
    DECODE = "decode"
    RENDER = "render"
    MODEL = "model"
    FIT = "fit"


@dataclass(frozen=True)
class PixelBudget:
    """The caps on one image's pixels, by who sets them (module docstring); None: no cap."""

    job_cap: int | None = None
    task_preset: int | None = None
    fit_cap: int | None = None
    intake_limit: int | None = None
    model_floor: int = 0
    model_limit: int | None = None

    def view(self) -> int | None:
        """Pixels the model sees at most: the job's cap, else the task's preset, else the model's
        limit; within the model's range; then the planner's fit, if any. None: no view (keep)."""
        fit = None if self.fit_cap is None else max(self.fit_cap, self.model_floor)
        if self.model_limit is None:
            return fit
        cap = self.job_cap or self.task_preset or self.model_limit
        cap = max(self.model_floor, min(cap, self.model_limit))
        return cap if fit is None else min(cap, fit)

    def at(self, stage: Stage) -> int | None:
        """How many pixels this image may have at `stage` (None: any, the stage keeps it);
        never more than the intake lets in, at any stage."""
        if stage is Stage.DECODE:
            cap = self.model_limit
        elif stage is Stage.RENDER:
            cap = replace(self, fit_cap=None).view()
        else:  # MODEL and FIT: the fit, once set, is part of what the model sees
            cap = self.view()
        return _least(cap, self.intake_limit)

    def render_target(self) -> int | None:
        """The pixels a document page is drawn at: the render stage's answer where the model
        has a view; None where it has none (the CPU engine), and the page is drawn at the
        default DPI, within the render stage's answer as a ceiling. Why apart from `at`: that
        answer is a most-allowed, and drawn to as a target it put the CPU engine's pages at the
        intake limit (40 MP: the 300 dpi cap) instead of 200 dpi."""
        return None if self.model_limit is None else self.at(Stage.RENDER)

    def fitted(self, pixels: int) -> PixelBudget:
        """This budget with the planner's fit at `pixels`: never below the model's floor (the
        processor would scale the image back up), never above what the model sees already."""
        fit = max(pixels, self.model_floor)
        view = self.view()
        return replace(self, fit_cap=fit if view is None else min(fit, view))


def _least(*caps: int | None) -> int | None:
    known = [c for c in caps if c is not None]
    return min(known) if known else None


def scaled_size(size: tuple[int, int], pixels: int, floor: int = 0) -> tuple[int, int]:
    """(w, h) shrunk keeping the aspect ratio so that w*h <= `pixels` (each side at least 1);
    `size` itself when it is within. The arithmetic of ocrq/intake/images.py `downscale`.

    With a `floor` (the model's), never under it: where rounding each side down would land
    below it (`pixels` at the floor, or within a row of it), each side is rounded up instead, the
    smallest size of that aspect with at least `floor` pixels. A copy under the floor would be
    scaled back up by the processor: shrunk, then grown."""
    w, h = size
    if w * h <= pixels:
        return size
    scale = math.sqrt(pixels / (w * h))
    shrunk = max(1, int(w * scale)), max(1, int(h * scale))
    if shrunk[0] * shrunk[1] >= floor:
        return shrunk
    if w * h <= floor:
        return size
    scale = math.sqrt(floor / (w * h))
    # Rounded up, but not past an integer that float error only grazes (1012 * sqrt(1e6 /
    # 1012**2) is 1000.0000000000001): then one more a side where that falls short.
    fw, fh = min(w, math.ceil(w * scale - 1e-9)), min(h, math.ceil(h * scale - 1e-9))
    if fw * fh < floor:
        fw, fh = min(w, fw + 1), min(h, fh + 1)
    return fw, fh
