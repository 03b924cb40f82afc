"""The batcher: planning by budget, exactly-once futures, OOM recovery.

The OOM engine below is the one fake the project allows: a CUDA OOM cannot happen on a CPU
machine, so it raises torch's own OutOfMemoryError above a pixel threshold. The same batcher
runs the real CPU engine in the last test, and the real tiny HunyuanOCR in test_hunyuan_oom.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from PIL import Image

from models.base import Engine, OcrResult, PreparedImage
from models.costs import CostModel, ItemCost
from worker.batcher import BatchConfig, Batcher

MiB = 1024**2


class OomAbovePixels(Engine):
    """Runs a batch only when its total pixels stay under `limit`, like a device would."""

    name = "oom-fake"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[int] = []

    def load(self) -> None:
        pass

    def estimate(self, item: PreparedImage) -> ItemCost:
        w, h = item.image.size
        return ItemCost(tokens=1, patches=w * h, pixels=w * h)

    def cost_model(self) -> CostModel:
        return CostModel(fixed_bytes=0, per_patch_bytes=1.0)  # a byte per pixel

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        pixels = sum(i.image.size[0] * i.image.size[1] for i in batch)
        self.calls.append(len(batch))
        if pixels > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {pixels} > {self.limit}")
        return [OcrResult(text=f"{i.key}:{i.image.size[0]}x{i.image.size[1]}") for i in batch]


def item(key: str, side: int) -> PreparedImage:
    return PreparedImage(key=key, image=Image.new("RGB", (side, side)), original_size=(side, side))


def test_oom_splits_retries_lowers_and_raises_budget() -> None:
    engine = OomAbovePixels(limit=4 * 100 * 100)  # the "device" holds 4 images of 100x100
    config = BatchConfig(
        max_items=16,
        wait_s=0.2,
        budget_bytes=16 * 100 * 100,
        clean_batches_to_raise=2,
        budget_step=0.25,
    )
    batcher = Batcher(engine, config).start()
    futures = [batcher.submit(item(f"k{i}", 100)) for i in range(16)]
    outcomes = [f.result(timeout=30) for f in futures]
    assert all(o.error is None for o in outcomes)  # no job failed for the OOMs
    assert [o.result.text for o in outcomes] == [f"k{i}:100x100" for i in range(16)]
    assert batcher.oom_events >= 1
    assert batcher.budget_bytes < config.budget_bytes  # lowered below the failing prediction
    assert max(engine.calls[1:]) <= 8
    lowered = batcher.budget_bytes
    # Clean batches raise the budget again, slowly.
    for round_ in range(4):
        for f in [batcher.submit(item(f"r{round_}-{i}", 100)) for i in range(2)]:
            assert f.result(timeout=30).error is None
    assert batcher.budget_bytes > lowered
    batcher.stop()
    assert batcher.records[0].oom_events >= 1


def test_single_image_oom_is_downscaled_not_failed() -> None:
    engine = OomAbovePixels(limit=50 * 50)
    batcher = Batcher(engine, BatchConfig(max_items=4, budget_bytes=10**9)).start()
    outcome = batcher.submit(item("big", 200)).result(timeout=30)
    batcher.stop()
    assert outcome.error is None
    w, h = map(int, outcome.result.text.split(":")[1].split("x"))
    assert w * h <= 50 * 50 and batcher.oom_events >= 2


def test_planner_downscales_image_over_budget_alone() -> None:
    engine = OomAbovePixels(limit=10**9)
    batcher = Batcher(engine, BatchConfig(max_items=4, budget_bytes=100 * 100)).start()
    outcome = batcher.submit(item("huge", 400)).result(timeout=30)
    batcher.stop()
    assert outcome.error is None and batcher.oom_events == 0  # shrunk before, never OOMed
    w, h = map(int, outcome.result.text.split(":")[1].split("x"))
    assert w * h <= 100 * 100


class Exploding(OomAbovePixels):
    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        raise RuntimeError("engine crashed")


def test_non_oom_failure_resolves_every_future_once() -> None:
    batcher = Batcher(Exploding(0), BatchConfig(max_items=8, wait_s=0.2, budget_bytes=10**9))
    batcher.start()
    futures = [batcher.submit(item(f"k{i}", 10)) for i in range(5)]
    outcomes = [f.result(timeout=30) for f in futures]
    batcher.stop()
    assert all(isinstance(o.error, RuntimeError) for o in outcomes)
    assert len({o.batch_id for o in outcomes}) == 1


def test_real_cpu_engine_batches() -> None:
    from models.rapid import RapidEngine
    from ocrq.samples import draw_text_image

    engine = RapidEngine()
    engine.load()
    batcher = Batcher(engine, BatchConfig(max_items=8, wait_s=0.3, budget_bytes=4 * 1024 * MiB))
    batcher.start()
    words = ["ALPHA", "BRAVO", "CHARLIE", "DELTA"]
    futures = []
    for w in words:
        img = draw_text_image([w], margin=4)
        futures.append(batcher.submit(PreparedImage(w, img, img.size)))
    outcomes = [f.result(timeout=120) for f in futures]
    batcher.stop()
    assert [o.result.text.upper() for o in outcomes] == words
    assert len({o.batch_id for o in outcomes}) < len(words)


@pytest.mark.parametrize("budget", [0, -1])
def test_invalid_config_refused(budget: int) -> None:
    with pytest.raises(ValueError):
        Batcher(OomAbovePixels(1), BatchConfig(budget_bytes=budget))
