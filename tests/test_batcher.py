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

from ocrq.models.base import Engine, OcrResult, PreparedImage
from ocrq.models.costs import CostModel, ItemCost
from ocrq.scheduling.batcher import StaticBatcher as Batcher
from ocrq.scheduling.vocabulary import BatchConfig

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


class Preparing(OomAbovePixels):
    """Keeps engine-private inputs in `item.encoded`, as HunyuanOCR does, and records what ran."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.ran: list[PreparedImage] = []

    def prepare(self, item: PreparedImage) -> None:
        item.encoded = ("pixels of", item.image.size)

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        self.ran.extend(batch)
        return super().run(batch)


def test_downscale_makes_a_new_item_and_leaves_the_submitted_one_alone() -> None:
    engine = Preparing(limit=10**9)
    original = item("huge", 400)
    engine.prepare(original)
    before = original.encoded
    batcher = Batcher(engine, BatchConfig(max_items=4, budget_bytes=100 * 100)).start()
    outcome = batcher.submit(original).result(timeout=30)
    batcher.stop()
    assert outcome.error is None
    (ran,) = engine.ran
    assert ran is not original and ran.key == original.key
    assert ran.image.size[0] * ran.image.size[1] <= 100 * 100
    assert ran.encoded is None  # the old pixels' preprocessing never reaches the engine
    assert original.image.size == (400, 400) and original.encoded is before


def test_image_too_big_at_any_size_fails_alone() -> None:
    engine = OomAbovePixels(limit=10**9)
    batcher = Batcher(engine, BatchConfig(max_items=4, wait_s=0.2, budget_bytes=1000)).start()
    futures = [batcher.submit(item("huge", 400)), batcher.submit(item("a", 20))]
    futures.append(batcher.submit(item("b", 20)))
    huge, a, b = (f.result(timeout=30) for f in futures)
    batcher.stop()
    assert isinstance(huge.error, MemoryError) and "over the budget" in str(huge.error)
    assert a.error is None and b.error is None and a.batch_id == b.batch_id
    assert batcher.oom_events == 0 and all(n == 2 for n in engine.calls)


def test_single_image_out_of_memory_at_every_size_fails_alone() -> None:
    engine = OomAbovePixels(limit=10)  # not even the smallest retry fits
    batcher = Batcher(engine, BatchConfig(max_items=4, budget_bytes=10**9)).start()
    outcome = batcher.submit(item("big", 200)).result(timeout=30)
    assert batcher.submit(item("tiny", 3)).result(timeout=30).error is None  # worker goes on
    batcher.stop()
    assert isinstance(outcome.error, MemoryError) and "out of memory" in str(outcome.error)
    assert batcher.oom_events == len(engine.calls) - 1 >= 2


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
    from ocrq.core.samples import draw_text_image
    from ocrq.models.rapid import RapidEngine

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


def test_every_batcher_speaks_the_batcher_protocol() -> None:
    """The job runner holds whichever batcher the runtime built through the one `Batcher`
    surface: a batcher kind missing a member would fail only when that path runs."""
    from ocrq.engine_process.link import RemoteBatcher, RemoteEngine
    from ocrq.models.base import EngineCore, EngineFront
    from ocrq.scheduling.streaming import StreamingBatcher
    from ocrq.scheduling.vocabulary import Batcher as BatcherProtocol

    members = ("submit", "pending", "cancel", "stop", "budget_bytes", "oom_events")
    for kind in (Batcher, StreamingBatcher, RemoteBatcher):
        missing = [m for m in members if not hasattr(kind, m)]
        assert not missing, f"{kind.__name__} lacks {missing}"
    batcher = Batcher(OomAbovePixels(10**9), BatchConfig(max_items=4)).start()
    try:
        assert isinstance(batcher, BatcherProtocol)
        assert batcher.submit(item("a", 8)).result(timeout=30).error is None
    finally:
        batcher.stop()
    front = ("prepare", "pixel_budget", "close", "prepares_here", "model_limit", "name")
    for kind in (EngineCore, RemoteEngine):
        assert all(hasattr(kind, m) or m in ("name", "model_limit") for m in front), kind
    assert EngineFront is not None and RemoteEngine.prepares_here is False
    assert not hasattr(RemoteEngine, "estimate")  # estimated where its batcher runs
