"""Smaller copies of waiting images, for the planner's size search and the batcher's execution.

The planner decides sizes from costs alone (ocrq/scheduling/planner.py `estimate_at`); an engine's
estimate, though, is a function of a PreparedImage. A `Downscaler` is that bridge for one
planning round: it makes each candidate size once (each from the smallest copy made so far, as
repeated halving did before), estimates it, and hands the batcher the very copy the plan chose.

The size of a copy is the image's pixel budget's answer at its fit stage
(ocrq/core/pixel_budget.py): the planner's pixels, never below the model's floor (where the
processor would scale the copy back up: the copy's sides are rounded up at the floor, not down)
nor above what the model sees already. A copy that would cost the engine no less than the image
it is made from is not made (near the floor the processor's grid makes 48x96 and a 46x91 copy
of it both 64x96; it would shrink the image for the processor to scale it back up): the image is
handed as it is, and the planner finds that the smaller size costs no less.

Every copy is a NEW PreparedImage (`dataclasses.replace`) with `encoded` empty, since the
engine's preprocessing of the old pixels does not hold for the new ones: `run` redoes it. The
waiting item itself is never changed, so a copy that was estimated and not chosen costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ocrq.core.pixel_budget import Stage
from ocrq.intake.images import downscale
from ocrq.models.base import EngineCore, PreparedImage
from ocrq.models.costs import ItemCost


class Downscaler:
    def __init__(self, engine: EngineCore, items: Mapping[str, PreparedImage]) -> None:
        self._engine = engine
        self._items = items
        self._made: dict[tuple[str, int], PreparedImage] = {}
        self._costs: dict[tuple[str, tuple[int, int]], ItemCost] = {}  # by key and image size

    def estimate_at(self, key: str, pixels: int) -> ItemCost:
        """The engine's cost of item `key` shrunk to at most `pixels` pixels."""
        return self._cost(key, self.item_at(key, pixels))

    def item_at(self, key: str, pixels: int) -> PreparedImage:
        """Item `key` shrunk to at most `pixels` pixels (aspect ratio kept) as its budget's
        fit stage allows, made once."""
        original = self._items[key]
        budget = self._engine.pixel_budget(original.task, original.job_cap).fitted(pixels)
        pixels = budget.at(Stage.FIT) or pixels
        made = self._made.get((key, pixels))
        if made is not None:
            return made
        # Shrink from the smallest copy that is still at least this large: cheap on a big page.
        larger = [
            item
            for (k, p), item in self._made.items()
            if k == key and p >= pixels and _area(item) >= pixels
        ]
        source = min(larger, key=_area, default=original)
        made = replace(original, image=source.image, encoded=source.encoded)
        if _area(source) > pixels:
            image = downscale(source.image, pixels, budget.model_floor)
            copy = replace(original, image=image, encoded=None)
            if image is not source.image and _cheaper(self._cost(key, copy), self._cost(key, made)):
                made = copy
        self._made[(key, pixels)] = made
        return made

    def _cost(self, key: str, item: PreparedImage) -> ItemCost:
        """The engine's estimate of item `key` at `item`'s size, once per size (an estimate is
        a function of the job's fields, the same for every copy, and of the image's size)."""
        at = (key, item.image.size)
        cost = self._costs.get(at)
        if cost is None:
            cost = self._costs[at] = self._engine.estimate(item)
        return cost


def _cheaper(cost: ItemCost, than: ItemCost) -> bool:
    """Less in some term of the estimate, more in none."""
    terms = ((cost.tokens, than.tokens), (cost.patches, than.patches), (cost.pixels, than.pixels))
    return cost != than and all(a <= b for a, b in terms)


def _area(item: PreparedImage) -> int:
    w, h = item.image.size
    return w * h
