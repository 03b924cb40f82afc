"""How many tokens and patches one image costs HunyuanOCR, computed without torch.

Why a pure module: the planner sizes every batch before any GPU work happens and runs on hosts
where torch is not installed, so the resize rule and the token formulas of the HunYuanVL image
processor and processor live here as plain arithmetic. The unit tests check these numbers against
the real processor's output for tiny, huge and odd-aspect images.

The rule (HunYuanVLImageProcessor): resize to a multiple of `patch * merge` (32) on each side,
keeping the aspect ratio, so that the area lies in [min_pixels, max_pixels] (512² and 2048² for
HunyuanOCR 1.0, about 4096² for 1.5; the engine reads them from the loaded processor). The
vision encoder then sees P = (h/16)(w/16) patches, and the language model N = (h/32)(w/32 + 1)
+ 2 image tokens: one per merged 2x2 patch, a newline token closing every row, and begin/end
tokens around the image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ocrq.models.costs import ItemCost

# Released checkpoints' image processor and vision config.
PATCH_SIZE = 16
MERGE_SIZE = 2
MIN_PIXELS = 512 * 512
MAX_PIXELS = 2048 * 2048
MAX_ASPECT_RATIO = 200


class ImageShapeError(ValueError):
    """The image cannot be fed to the model (aspect ratio beyond what the processor accepts)."""


@dataclass(frozen=True)
class ImageGeometry:
    """The processor's resize rule and token layout, as read from a loaded processor."""

    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    extra_tokens: int = 2  # begin/end embeddings the processor adds to every image span

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the processor resizes an image of this size to."""
        if width < 1 or height < 1:
            raise ImageShapeError(f"image has no pixels: {width}x{height}")
        if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            raise ImageShapeError(
                f"image {width}x{height} has an aspect ratio above {MAX_ASPECT_RATIO}:1, which "
                "HunyuanOCR's processor refuses; crop or split it first"
            )
        f = self.factor
        # Python's round() (half to even), as the processor uses.
        h = round(height / f) * f
        w = round(width / f) * f
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / scale / f) * f)
            w = max(f, math.floor(width / scale / f) * f)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * scale / f) * f
            w = math.ceil(width * scale / f) * f
        return w, h

    def shrink_to(self, width: int, height: int, cap: int) -> tuple[int, int]:
        """The size to resize an image to, before the processor, so that the model sees at most
        `cap` pixels of it (a resolution preset, a job's cap); (width, height) itself when the
        cap changes nothing, so the processor makes its one resize as it would without one.

        The answer is a size this fit keeps: `capped` of it is itself. Every later stage asks
        the fit again of the image the fit made (the engine's estimate of a prepared item,
        `run`'s preprocessing of a planner's copy), and a fit that moved its own answer shrank
        an image twice: `capped` once is the processor's rule with the cap as its limit, whose
        answer a second pass can still move (a thin image: 26x197 under a cap at a 64² floor is
        32x160, its short side held at one grid cell, over the cap; the rule made again of
        32x160 is 32x128), so the step is repeated until it keeps its answer (each step shrinks,
        so this ends; the image is still resized once, to the last size).
        """
        if cap >= self.max_pixels:
            return width, height
        size = (width, height)
        while (smaller := self.capped(*size, cap)) != size:
            size = smaller
        return size

    def capped(self, width: int, height: int, cap: int) -> tuple[int, int]:
        """One step of `shrink_to`: the processor's rule with `cap` as its limit, or the image
        itself where that would not show the model fewer of the image's pixels.

        Near the floor the rule floors both sides and can land under the floor (48x96 under a
        cap at a 64² floor: 32x64), where the processor raises it, ceiling both sides (64x96):
        the cap cannot be met at this aspect, and the raise can show the model more than the
        image itself would, hold more pixels than the image, or only change its aspect. So the
        image is kept when

        * the capped size has at least as many pixels as the processor makes of the image
          itself (a cap never shows the model more) or as the image has (ocrq never scales an
          image up: the processor's own resize is the one raise of an image under its floor);
        * the cap lands under the floor and the image is on the grid already (the processor
          keeps it): raising its capped size would change its aspect, not meet the cap (this
          fit makes a 53x159 page 64x128 under that cap; a second one would make it 64x96).

        Without these a later stage found a raised copy over its cap and shrank it again (CI:
        48x96 -> 64x96 -> 52x78, which the processor made 64x64). Otherwise the answer is a
        multiple of the factor on each side within the limits, which the processor keeps: its
        rule once, then again while it moves its own answer, which it does only where it holds
        a short side at one grid cell and so answers over its limit (past max_pixels/factor² to
        1: 36:1 for a tiny test checkpoint's 192², beyond the 200:1 it accepts for a released
        one).
        """
        natural = self.resized(width, height)
        limited = replace(self, max_pixels=max(cap, self.min_pixels)).resized(width, height)
        if _area(limited) < self.min_pixels and natural == (width, height):
            return width, height
        try:
            size = self.resized(*limited)
            while (again := self.resized(*size)) != size:  # a size the processor keeps (below)
                size = again
        except ImageShapeError:  # a side held at one cell, past 200:1: no cap at this aspect
            return width, height
        if _area(size) >= min(_area(natural), width * height):
            return width, height
        return size

    def vit_patches(self, width: int, height: int) -> int:
        """Patches the vision encoder processes for this image: P = (h/16)(w/16)."""
        w, h = self.resized(width, height)
        return (h // self.patch_size) * (w // self.patch_size)

    def image_tokens(self, width: int, height: int) -> int:
        """Tokens the image occupies in the language model: N = (h/32)(w/32 + 1) + 2."""
        w, h = self.resized(width, height)
        return (h // self.factor) * (w // self.factor + 1) + self.extra_tokens


def _area(size: tuple[int, int]) -> int:
    return size[0] * size[1]


DEFAULT_GEOMETRY = ImageGeometry()


def item_cost(
    width: int,
    height: int,
    *,
    prompt_tokens: int,
    max_new_tokens: int,
    geometry: ImageGeometry = DEFAULT_GEOMETRY,
) -> ItemCost:
    """ItemCost of one image: tokens = prompt + N + max_new_tokens, patches = P, pixels = h*w.

    `prompt_tokens` counts every token of the templated prompt except the image span.
    """
    w, h = geometry.resized(width, height)
    return ItemCost(
        tokens=prompt_tokens + geometry.image_tokens(width, height) + max_new_tokens,
        patches=geometry.vit_patches(width, height),
        pixels=w * h,
        new_tokens=max_new_tokens,
    )


def geometry_of(processor: object) -> ImageGeometry:
    """The resize rule and token layout of a loaded HunYuanVLProcessor (tiny test checkpoints
    have other limits than the released 512²..2048²)."""
    image_processor = processor.image_processor  # type: ignore[attr-defined]
    size = image_processor.size
    return ImageGeometry(
        patch_size=int(image_processor.patch_size),
        merge_size=int(image_processor.merge_size),
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
        extra_tokens=2 if getattr(processor, "cat_extra_token", True) else 0,
    )
