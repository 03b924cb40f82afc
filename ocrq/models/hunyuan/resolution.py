"""Resolution presets: how many pixels of an image each task shows the model.

Why per task: the image's pixels are most of a row's tokens ((h/32)(w/32+1)+2 image tokens, and
16x as many patches in the vision tower, whose attention is global), so they set both the memory
of a batch and its prefill time, while the resolution a task needs differs. Tencent gives no
per-task advice (its clients send every image at the model's limit, ~4096² for 1.5, where a 300
dpi A4 page, 2480x3508, is 8,692 image tokens and 34,320 vision patches: HunyuanOCR issue #114);
the seed guide's reading is:

* documents (parse, layout, tables, formulas, charts, document translation) are read clearly at
  ~1024-1536 px on the long side, the resolution documents are scanned for reading; the cap is
  1536² pixels (2.36 MP: an A4 page at ~157 dpi, 1280x1824 after the resize, 2,339 image
  tokens where its 300 dpi scan gives 8,692);
* scene text (spotting, plain text of street views and old prints, scene translation) has small
  text anywhere in a large photo, so it keeps more: 2048² (1.0's own limit; 4.2 MP);
* subtitles keep their size (a frame is small already, the model's limit is the cap), and so
  do free prompts, whose needs ocrq cannot know.

A worker overrides any of these (OCRQ_TASK_MAX_PIXELS), a job sets its own (`max_pixels` in the
request), and the model's own limit (the loaded processor's) always applies on top: the preset is
the `task_preset` of the image's pixel budget (ocrq/core/pixel_budget.py), which resolves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ocrq.core.pixel_budget import PixelBudget, Stage

if TYPE_CHECKING:
    from ocrq.models.base import PreparedImage
    from ocrq.models.hunyuan.geometry import ImageGeometry

DOCUMENT_PIXELS = 1536 * 1536
SCENE_PIXELS = 2048 * 2048

TASK_MAX_PIXELS: dict[str, int] = {
    "parse": DOCUMENT_PIXELS,
    "layout": DOCUMENT_PIXELS,
    "layout_parse": DOCUMENT_PIXELS,
    "table": DOCUMENT_PIXELS,
    "formula": DOCUMENT_PIXELS,
    "chart": DOCUMENT_PIXELS,
    "translate_doc_zh": DOCUMENT_PIXELS,
    "text": SCENE_PIXELS,
    "spotting": SCENE_PIXELS,
    "spotting_json": SCENE_PIXELS,
    "translate_en": SCENE_PIXELS,
    "translate_zh": SCENE_PIXELS,
    # "subtitles" and "custom" (free prompts): the model's own limit.
}


def pixel_budget(
    task: str,
    job_cap: int | None,
    overrides: Mapping[str, int],
    model_floor: int,
    model_limit: int,
) -> PixelBudget:
    """The pixel budget of a `task` image: the job's cap, the worker's preset for the task else
    the default one (none for subtitles and free prompts: the model's limit), and the model's
    range, which the budget applies on top (ocrq/core/pixel_budget.py)."""
    return PixelBudget(
        job_cap=job_cap,
        task_preset=overrides.get(task) or TASK_MAX_PIXELS.get(task),
        model_floor=model_floor,
        model_limit=model_limit,
    )


class ModelPixels:
    """`pixel_budget` and `view_pixels` for a HunyuanOCR front (the fast-path engine and the
    served model vLLM and the openai engine share): one definition, from the loaded model's
    `geometry` and the worker's `task_max_pixels`."""

    geometry: ImageGeometry
    settings: Any  # a settings group with `task_max_pixels`

    def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget:
        """The job's cap, the task's preset (OCRQ_TASK_MAX_PIXELS, else this module's), within
        the loaded model's range: what every stage of a `task` image asks."""
        g = self.geometry
        return pixel_budget(
            task, job_cap, self.settings.task_max_pixels, g.min_pixels, g.max_pixels
        )

    def view_pixels(self, item: PreparedImage) -> int:
        """Pixels the model sees of `item`: its budget's answer at the model stage."""
        view = self.pixel_budget(item.task, item.job_cap).at(Stage.MODEL)
        assert view is not None  # a budget with a model limit always has a view
        return view
