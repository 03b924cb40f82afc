"""The tensor preprocessing path (ocrq/models/hunyuan/pixels.py, spans.py) against transformers'
processor, on real evaluation images of many sizes and on odd shapes, for the tiny 1.0 and 1.5.

Tolerance: none on the CPU. The tensor path runs the processor's own uint8 resize kernel and its
own two float32 operations (subtract the fused mean, divide by the fused std), so pixel_values,
image_grid_thw, input_ids, mm_token_type_ids and the RoPE positions are compared with
torch.equal, in float32 and after the model's bf16 cast. The float resize a GPU would use is
checked apart: ~10% of its pixels one uint8 level off the CPU's, a few in 10,000 more.

The comparison is shown to fail on the mistakes that would matter: patches in Qwen's
merge-window order instead of HunYuanVL's raster order, a normalisation without the std, the
CLIP mean taken in the wrong channel order, and an image-span one token short.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.geometry import ImageGeometry, geometry_of
from ocrq.models.hunyuan.inputs import EncodedImage, Preprocessor
from ocrq.models.hunyuan.prompts import VERSION_PROMPTS
from tests.conftest import eval_data
from tests.tiny_hunyuan import MODEL_ID, cpu_settings, item, noise, offline_tiny_cache

pytestmark = pytest.mark.hunyuan

SUBFOLDER = {"1.0": "v1.0", "1.5": None}
# The released limits, so real pages are compared at the sizes the model sees them (the tiny
# checkpoints' own limits, 64²..192², shrink every page to a few patches).
RELEASED = {"1.0": (512 * 512, 2048 * 2048), "1.5": (512 * 512, 4096 * 4096)}
# Evaluation images of different shapes: word crops, scene photos, receipts, a 300 dpi page.
EVAL_IMAGES = [
    "svt/word_crops/12_03_0.jpg",
    "svt/word_crops/16_13_0.jpg",
    "svt/scene/10_04.jpg",
    "sroie/img/548.jpg",
    "sroie/img/086.jpg",
    "tesseract_test/eurotext.tif",
    "tesseract_test/8071_093.3B.tif",
]
ODD_SIZES = [(37, 1001), (1001, 37), (5, 900), (1, 1), (33, 33), (2049, 31)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, HunyuanEngine]]:
    with offline_tiny_cache(tmp_path_factory.mktemp("hf")):
        loaded = {}
        for version, subfolder in SUBFOLDER.items():
            eng = HunyuanEngine.from_settings(cpu_settings(MODEL_ID, 4, subfolder=subfolder))
            eng.load()
            loaded[version] = eng
        yield loaded


@pytest.fixture(scope="module", params=["1.0", "1.5"])
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def preprocessors(
    engine: HunyuanEngine, limits: tuple[int, int] | None, dtype: Any = None
) -> tuple[Preprocessor, Preprocessor]:
    """(tensor, processor) preprocessors of the loaded engine, at `limits` (min, max pixels)
    instead of the tiny checkpoint's when given, in the model's dtype or `dtype`."""
    import copy

    processor = engine.processor
    if limits is not None:
        processor = copy.deepcopy(engine.processor)
        processor.image_processor.size["shortest_edge"] = limits[0]
        processor.image_processor.size["longest_edge"] = limits[1]
    model: Any = engine.model
    if dtype is not None:
        model = _DtypeView(engine.model, dtype)
    geometry = geometry_of(processor)
    made = []
    for mode in ("tensor", "processor"):
        made.append(
            Preprocessor(
                model,
                processor,
                engine.templates,  # type: ignore[arg-type]
                geometry,
                pin=False,
                prompt_for=engine.prompt_for,
                cap_of=engine.view_pixels if limits is None else lambda _: geometry.max_pixels,
                mode=mode,
            )
        )
    return made[0], made[1]


class _DtypeView:
    """The model as the Preprocessor sees it, with another dtype (a bf16 model on the CPU)."""

    def __init__(self, model: Any, dtype: Any) -> None:
        self.model, self.config, self.dtype = model.model, model.config, dtype


def assert_rows_equal(a: EncodedImage, b: EncodedImage) -> None:
    import torch

    assert a.pixel_values.dtype == b.pixel_values.dtype
    assert a.pixel_values.shape == b.pixel_values.shape
    assert torch.equal(a.image_grid_thw, b.image_grid_thw)
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.mm_token_type_ids, b.mm_token_type_ids)
    assert a.positions is not None and b.positions is not None
    assert torch.equal(a.positions, b.positions)
    diff = (a.pixel_values.float() - b.pixel_values.float()).abs().max()
    assert torch.equal(a.pixel_values, b.pixel_values), f"pixels differ by up to {diff}"


def rgb(path: Path) -> Image.Image:
    with Image.open(path) as img:
        return img.convert("RGB")


@pytest.mark.parametrize("name", EVAL_IMAGES)
def test_tensor_rows_equal_the_processors_on_real_images(
    engines: dict[str, HunyuanEngine], version: str, name: str
) -> None:
    """At the released limits (the model's real page sizes) and the tiny ones (heavy resize)."""
    engine = engines[version]
    image = rgb(eval_data() / name)
    text, _ = engine.templates(VERSION_PROMPTS[version]["text"])  # type: ignore[misc]
    for limits in (RELEASED[version], None):
        tensor, processor = preprocessors(engine, limits)
        ours, theirs = tensor.encode(text, image), processor.encode(text, image)
        assert_rows_equal(ours, theirs)
    assert ours.image_grid_thw[0, 0] == 1


@pytest.mark.parametrize("size", ODD_SIZES)
def test_tensor_rows_equal_the_processors_on_odd_sizes(
    engines: dict[str, HunyuanEngine], version: str, size: tuple[int, int]
) -> None:
    engine = engines[version]
    image = noise(*size, seed=size[0] * 7 + size[1])
    for prompt in VERSION_PROMPTS[version].values():
        text, _ = engine.templates(prompt)  # type: ignore[misc]
        tensor, processor = preprocessors(engine, RELEASED[version])
        assert_rows_equal(tensor.encode(text, image), processor.encode(text, image))


def test_bf16_rows_equal_the_processors_after_the_cast(engines: dict[str, HunyuanEngine]) -> None:
    """The engine stages pixels in the model's dtype: the tensor path writes bf16 directly, the
    processor's float32 is cast; the two agree bit for bit."""
    import torch

    engine = engines["1.5"]
    image = rgb(eval_data() / "sroie/img/086.jpg")
    text, _ = engine.templates(VERSION_PROMPTS["1.5"]["parse"])  # type: ignore[misc]
    tensor, processor = preprocessors(engine, RELEASED["1.5"], dtype=torch.bfloat16)
    ours = tensor.encode(text, image)
    assert ours.pixel_values.dtype == torch.bfloat16
    assert_rows_equal(ours, processor.encode(text, image))


def test_whole_items_through_the_engine_equal(engines: dict[str, HunyuanEngine]) -> None:
    """The engine's own entry (mode conversion, resolution cap) in both modes, and its output
    tokens: a grey, an RGBA and a capped image."""
    import torch

    engine = engines["1.0"]
    assert engine.preprocess_row is not None and engine.preprocess_row.mode == "tensor"
    tensor, processor = preprocessors(engine, None)
    items = [item(150, 100, 1), item(90, 160, 2, task="spotting"), item(300, 40, 3)]
    items[0].image = items[0].image.convert("L")
    items[1].image = items[1].image.convert("RGBA")
    items[2].job_cap = 64 * 64
    ours = [tensor(i) for i in items]
    theirs = [processor(i) for i in items]
    for a, b in zip(ours, theirs, strict=True):
        assert_rows_equal(a, b)
    out_a = engine.generate(items, encoded=ours, output_logits=True)
    out_b = engine.generate(items, encoded=theirs, output_logits=True)
    for a, b in zip(out_a.items, out_b.items, strict=True):
        assert torch.equal(a.logits, b.logits)  # type: ignore[union-attr]


def test_resize_equals_torchvisions_and_the_float_path_is_within_a_level() -> None:
    """The resize alone: equal to the processor's call of torchvision on the CPU; the float path
    (what a GPU runs) close to it, not equal."""
    import numpy as np
    import torch
    from torchvision.transforms.v2 import functional as tvF

    from ocrq.models.hunyuan.pixels import resize_uint8

    image = rgb(eval_data() / "sroie/img/086.jpg")  # 932x2067
    hwc = torch.from_numpy(np.asarray(image).copy())
    geometry = ImageGeometry()
    for size in [(932, 2067), (37, 1001), (3000, 40), (300, 200)]:
        chw = tvF.resize(hwc.permute(2, 0, 1).contiguous(), [size[1], size[0]])
        w, h = geometry.resized(*size)
        theirs = tvF.resize(chw, [h, w], interpolation=tvF.InterpolationMode.BICUBIC)
        ours = resize_uint8(chw.permute(1, 2, 0).contiguous().permute(2, 0, 1), h, w)
        assert torch.equal(ours, theirs)
        floated = resize_uint8(chw, h, w, native=False)
        diff = (floated.int() - theirs.int()).abs()
        # The uint8 kernel rounds and clips between its horizontal and vertical passes, the
        # float one does not: ~10% of pixels differ by a level, a few in 10,000 by more (up
        # to ~10 levels beside sharp text edges).
        assert float((diff > 1).float().mean()) < 0.005
        assert float(diff.float().mean()) < 0.2


def test_the_comparison_fails_on_wrong_patch_order_and_normalisation(
    engines: dict[str, HunyuanEngine],
) -> None:
    """Each mistake a reimplementation could make is caught by assert_rows_equal."""
    import dataclasses

    import torch

    from ocrq.models.hunyuan.pixels import PixelEncoder

    engine = engines["1.0"]
    image = rgb(eval_data() / "svt/scene/10_04.jpg")
    text, _ = engine.templates(VERSION_PROMPTS["1.0"]["text"])  # type: ignore[misc]
    tensor, processor = preprocessors(engine, RELEASED["1.0"])
    theirs = processor.encode(text, image)
    good = tensor.encode(text, image)
    assert_rows_equal(good, theirs)

    gh, gw = (int(v) for v in good.image_grid_thw[0, 1:])
    # Qwen2-VL's order: the 2x2 merge window's four patches next to each other.
    qwen = (
        good.pixel_values.view(gh // 2, 2, gw // 2, 2, -1)
        .permute(0, 2, 1, 3, 4)
        .reshape(gh * gw, -1)
    )
    # Each patch's row with the channel innermost instead of outermost.
    channel_last = good.pixel_values.view(-1, 3, 16, 16).permute(0, 2, 3, 1).reshape(gh * gw, -1)
    spec = tensor.pixels.spec  # type: ignore[union-attr]
    no_std = PixelEncoder(dataclasses.replace(spec, image_std=(1.0, 1.0, 1.0)), tensor.geometry)(
        image
    )[0]
    bgr_mean = PixelEncoder(
        dataclasses.replace(spec, image_mean=spec.image_mean[::-1]), tensor.geometry
    )(image)[0]
    short = torch.cat([good.input_ids[:-2], good.input_ids[-1:]])
    mutants = [
        dataclasses.replace(good, pixel_values=qwen),
        dataclasses.replace(good, pixel_values=channel_last),
        dataclasses.replace(good, pixel_values=no_std),
        dataclasses.replace(good, pixel_values=bgr_mean),
        dataclasses.replace(good, input_ids=short),
    ]
    for mutant in mutants:
        with pytest.raises(AssertionError):
            assert_rows_equal(mutant, theirs)


def test_a_tokenizer_that_merges_the_placeholder_is_refused(
    engines: dict[str, HunyuanEngine],
) -> None:
    """The splice is checked per template: a tokenizer that would not give the processor's ids
    for a repeated placeholder makes the tensor path refuse the template."""
    from ocrq.models.hunyuan.spans import RowSpans

    engine = engines["1.0"]
    spans = RowSpans(engine.processor, rope_axes=4, spatial_merge_size=2)
    real = spans.tokenizer

    class Merging:
        def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
            ids = list(real(text, **kwargs)["input_ids"])
            image = spans.image_token_id
            out: list[int] = []
            for t in ids:  # runs of placeholders collapse to one token, as a BPE merge might
                if not (t == image and out and out[-1] == image):
                    out.append(t)
            return {"input_ids": out}

    spans.tokenizer = Merging()
    text, _ = engine.templates(VERSION_PROMPTS["1.0"]["text"])  # type: ignore[misc]
    with pytest.raises(ValueError, match="one token"):
        spans.pieces(text)
