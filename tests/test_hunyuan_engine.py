"""HunyuanEngine on a tiny random HunYuanVL, loaded through the same path as the real checkpoint.

The checkpoint is written at test time (models/hunyuan/tiny.py) into a fake Hugging Face cache as
tencent/HunyuanOCR, revision main, subfolder v1.0, and the engine loads it by that id with
HF_HUB_OFFLINE=1: the code path a worker takes in production.

Batched == single is checked on per-step logits, not only token ids, and the checks are shown to
be able to fail: different images move the logits by orders of magnitude more than the tolerance,
and right padding breaks the padded rows.

torch is imported inside the tests so that collection works where it is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from models.base import OcrResult, PreparedImage
from models.hunyuan import HunyuanEngine, ModelNotFound
from models.hunyuan.checkpoint import resolve_model_dir
from models.hunyuan.generation import Generated
from models.hunyuan.geometry import ImageGeometry, ImageShapeError
from models.hunyuan.inputs import collate
from models.hunyuan.prompts import TASK_PRESETS
from ocrq.settings import Settings
from tests.tiny_hunyuan import (
    COMMIT,
    MODEL_ID,
    RightPadded,
    cpu_settings,
    item,
    max_diff,
    mixed,
    offline_tiny_cache,
)

pytestmark = pytest.mark.hunyuan

MAX_NEW = 8
# fp32 logits of a row move by ~1e-5 here between a batch and a batch of one (other BLAS builds
# have shown ~3e-3); different images move them by > 1.
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with offline_tiny_cache(tmp_path_factory.mktemp("hf")) as root:
        yield root


@pytest.fixture(scope="module")
def engine(hf_cache: Path) -> HunyuanEngine:
    eng = HunyuanEngine.from_settings(cpu_settings(MODEL_ID, MAX_NEW, subfolder="v1.0"))
    eng.load()
    return eng


@pytest.fixture(scope="module")
def mixed_batch() -> list[PreparedImage]:
    """Mixed resolutions and prompts, so the rows have different lengths and get padded."""
    return mixed(1, scale=3)


@pytest.fixture(scope="module")
def batched(engine: HunyuanEngine, mixed_batch: list[PreparedImage]) -> Any:
    return engine.generate(mixed_batch, output_logits=True)


@pytest.fixture(scope="module")
def singles(engine: HunyuanEngine, mixed_batch: list[PreparedImage]) -> list[Generated]:
    return [engine.generate([it], output_logits=True).items[0] for it in mixed_batch]


def test_loaded_through_the_cache_by_id(engine: HunyuanEngine, hf_cache: Path) -> None:
    assert engine.model_dir == hf_cache / f"models--tencent--HunyuanOCR/snapshots/{COMMIT}/v1.0"
    assert engine.model.config._attn_implementation == "sdpa"
    assert engine.processor.tokenizer.padding_side == "left"
    assert engine.geometry == ImageGeometry(min_pixels=64 * 64, max_pixels=160 * 160)
    assert engine.max_pixels == 160 * 160


def test_batch_is_padded(batched: Any, singles: list[Generated]) -> None:
    lengths = {g.prompt_tokens for g in singles}
    assert len(lengths) == len(singles)  # every row a different length
    assert batched.padded_length == max(lengths)


def test_batched_equals_single(batched: Any, singles: list[Generated]) -> None:
    for got, alone in zip(batched.items, singles, strict=True):
        assert got.token_ids == alone.token_ids
        assert got.text == alone.text
        assert got.logits.shape == alone.logits.shape == (MAX_NEW, 320)
        assert max_diff(got, alone) < TOLERANCE


def test_different_images_differ_far_beyond_tolerance(singles: list[Generated]) -> None:
    for other in singles[1:]:
        assert max_diff(singles[0], other) > 100 * TOLERANCE
    assert len({tuple(g.token_ids) for g in singles}) > 1


def test_right_padding_is_caught(
    engine: HunyuanEngine, mixed_batch: list[PreparedImage], singles: list[Generated]
) -> None:
    right = RightPadded.from_settings(engine.settings)
    right.load()
    broken = right.generate(mixed_batch, output_logits=True)
    longest = max(range(len(singles)), key=lambda i: singles[i].prompt_tokens)
    for i, (got, alone) in enumerate(zip(broken.items, singles, strict=True)):
        if i == longest:  # the one row without padding is unaffected
            assert max_diff(got, alone) < TOLERANCE
        else:
            assert max_diff(got, alone) > 100 * TOLERANCE


def test_rope_positions_are_per_row(
    engine: HunyuanEngine, mixed_batch: list[PreparedImage]
) -> None:
    """Row i of a batch gets the multimodal positions it gets alone (image index 0).

    transformers' own get_rope_index numbers images across the batch; the class method shows it.
    """
    import torch
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import HunYuanVLModel

    rows = [engine.preprocess(it) for it in mixed_batch]
    inputs = collate(rows, engine.tokens.pad)
    args = {k: inputs[k] for k in ("mm_token_type_ids", "image_grid_thw", "attention_mask")}
    together, deltas = engine.model.model.get_rope_index(inputs["input_ids"], **args)
    unpatched, _ = HunYuanVLModel.get_rope_index(engine.model.model, inputs["input_ids"], **args)
    for i, row in enumerate(rows):
        alone, delta = engine.model.model.get_rope_index(
            row.input_ids[None],
            mm_token_type_ids=row.mm_token_type_ids[None],
            image_grid_thw=row.image_grid_thw,
            attention_mask=torch.ones_like(row.input_ids)[None],
        )
        n = len(row.input_ids)
        assert torch.equal(together[:, i, -n:], alone[:, 0])
        assert int(deltas[i]) == int(delta[0])
        if i > 0:
            assert not torch.equal(unpatched[:, i, -n:], alone[:, 0])


@pytest.mark.parametrize("side", ["left", "right"])
def test_collated_positions_equal_the_librarys(
    engine: HunyuanEngine, mixed_batch: list[PreparedImage], side: str
) -> None:
    """Positions computed per row in preprocess and padded by collate are exactly what the
    row-isolated get_rope_index gives for the whole padded batch, padding columns included."""
    import torch

    rows = [engine.preprocess(it) for it in mixed_batch]
    assert all(r.positions is not None for r in rows)
    inputs = collate(rows, engine.tokens.pad, padding_side=side)
    args = {k: inputs[k] for k in ("mm_token_type_ids", "image_grid_thw", "attention_mask")}
    library, _ = engine.model.model.get_rope_index(inputs["input_ids"], **args)
    assert inputs["position_ids"].shape == library.shape
    assert torch.equal(inputs["position_ids"], library)
    # The image grid really is on the positions: a row's image tokens are not 0..n-1.
    n = len(rows[0].input_ids)
    assert not torch.equal(rows[0].positions[-1], torch.arange(n))


def test_estimate_matches_the_processor(
    engine: HunyuanEngine, mixed_batch: list[PreparedImage], singles: list[Generated]
) -> None:
    for it, alone in zip(mixed_batch, singles, strict=True):
        cost = engine.estimate(it)
        row = engine.preprocess(it)
        assert cost.tokens == alone.prompt_tokens + MAX_NEW == len(row.input_ids) + MAX_NEW
        assert cost.patches == row.pixel_values.shape[0]
        _, gh, gw = row.image_grid_thw[0].tolist()
        assert cost.pixels == gh * gw * 16 * 16


@pytest.mark.parametrize(
    "size",
    [(1, 1), (10, 10), (511, 513), (1024, 1024), (886, 1699), (1248, 1760), (2049, 2047),
     (4961, 7016), (3000, 20), (20, 3000), (33, 4000), (1700, 31)],
)
def test_estimator_matches_the_released_processor_settings(
    engine: HunyuanEngine, size: tuple[int, int]
) -> None:
    """With the released limits (512²..2048²): tokens and patches as the real processor counts."""
    from transformers import HunYuanVLImageProcessor, HunYuanVLProcessor

    from models.hunyuan.geometry import DEFAULT_GEOMETRY

    processor = HunYuanVLProcessor(
        image_processor=HunYuanVLImageProcessor(
            size={"shortest_edge": 512 * 512, "longest_edge": 2048 * 2048}
        ),
        tokenizer=engine.processor.tokenizer,
        chat_template=engine.processor.chat_template,
    )
    text, prompt_tokens = engine.templates(TASK_PRESETS["text"])
    enc = processor(text=[text], images=[Image.new("RGB", size, "white")], return_tensors="pt")
    assert DEFAULT_GEOMETRY.image_tokens(*size) == enc["input_ids"].shape[1] - prompt_tokens
    assert DEFAULT_GEOMETRY.vit_patches(*size) == enc["pixel_values"].shape[0]
    assert int((enc["mm_token_type_ids"] == 1).sum()) == DEFAULT_GEOMETRY.image_tokens(*size)


def test_processor_and_estimator_refuse_the_same_aspect(engine: HunyuanEngine) -> None:
    img = Image.new("RGB", (4020, 20), "white")
    with pytest.raises(ValueError, match="aspect ratio"):
        engine.processor.image_processor(images=[img])
    with pytest.raises(ImageShapeError):
        engine.estimate(PreparedImage("wide", img, img.size))


def test_run_returns_results_and_fails_bad_items_alone(
    engine: HunyuanEngine, mixed_batch: list[PreparedImage], singles: list[Generated]
) -> None:
    wide = PreparedImage("wide", Image.new("RGB", (4020, 20)), (4020, 20))
    gray = PreparedImage("gray", mixed_batch[0].image.convert("L"), mixed_batch[0].original_size)
    results = engine.run([mixed_batch[0], wide, mixed_batch[2], gray])
    assert isinstance(results[1], ImageShapeError)
    for res in (results[0], results[2], results[3]):
        assert isinstance(res, OcrResult)
    assert results[0].text == singles[0].text.strip()
    assert results[2].text == singles[2].text.strip()


def test_unknown_task_without_prompt_fails_alone(engine: HunyuanEngine) -> None:
    results = engine.run([item(64, 64, 9, task="custom"), item(64, 64, 9)])
    assert isinstance(results[0], ValueError)
    assert isinstance(results[1], OcrResult)


# --- model resolution -------------------------------------------------------------------------


def test_missing_model_names_id_and_fetch_command(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as err:
        resolve_model_dir("tencent/NoSuchOCR", "abc123", "v1.0")
    msg = str(err.value)
    assert "tencent/NoSuchOCR" in msg and "abc123" in msg and str(hf_cache) in msg
    assert "hf download tencent/NoSuchOCR --revision abc123 --include 'v1.0/*'" in msg


def test_missing_subfolder_in_cache_is_reported(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFound, match="subfolder v9"):
        resolve_model_dir(MODEL_ID, None, "v9")


def test_missing_local_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nowhere"), None, "v1.0")
    with pytest.raises(ModelNotFound, match="no HunyuanOCR checkpoint"):
        resolve_model_dir(str(tmp_path), None, "v1.0")


def test_engine_load_fails_at_startup_without_weights(hf_cache: Path) -> None:
    eng = HunyuanEngine(Settings(model="tencent/NoSuchOCR", device="cpu"))
    with pytest.raises(ModelNotFound, match="hf download"):
        eng.load()


def test_local_directory_with_and_without_subfolder(engine: HunyuanEngine) -> None:
    ckpt = engine.model_dir
    assert ckpt is not None
    assert resolve_model_dir(str(ckpt.parent), None, "v1.0") == ckpt
    assert resolve_model_dir(str(ckpt), None, "v1.0") == ckpt  # pointed at the folder itself


def test_eager_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="eager"):
        HunyuanEngine(Settings(attention="eager"))


def test_default_cost_model_covers_the_h200_measurements() -> None:
    """The default model never predicts less than the benchmark measured, nor 5% more."""
    import json

    results = Path(__file__).resolve().parents[1] / "bench/results/hunyuan_engine_h200.json"
    report = json.loads(results.read_text())
    engine = HunyuanEngine(Settings(max_new_tokens=report["meta"]["new_tokens"]))
    model = engine.cost_model()
    assert model.source == "default"
    used_after_load = report["meta"]["device_used_after_load_gib"] * 1024**3
    assert used_after_load <= model.fixed_bytes <= used_after_load * 1.05
    for run in report["runs"]:
        size = (run["width"], run["height"])
        cost = engine.estimate(PreparedImage("p", Image.new("RGB", size), size))
        predicted = model.batch_bytes([cost] * run["batch"])
        measured = run["increment_gib"] * 1024**3
        assert measured <= predicted <= measured * 1.05, run


def test_cache_token_bytes_follow_the_models_shape(engine: HunyuanEngine) -> None:
    """The decode coefficient is K and V of every layer plus one layer's share, in the model's
    dtype; before loading, the 1.0 shape's (24 layers x 8 KV heads x 128, bf16) = 100 KiB."""
    from models.hunyuan.memory import cache_token_bytes

    cfg = engine.model.config.text_config
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * engine.model.dtype.itemsize
    assert cache_token_bytes(engine.model) == per_layer * (cfg.num_hidden_layers + 1)
    assert engine.cost_model().per_cache_token_bytes == cache_token_bytes(engine.model)
    unloaded = HunyuanEngine(Settings()).cost_model()
    assert unloaded.per_cache_token_bytes == 2 * 8 * 128 * 2 * 25 == 100 * 1024


def test_default_cost_model_covers_the_fast_path_measurements() -> None:
    """The fast path's own default (fused prefill, graphed decode) against the decode bench on
    the H200: never below the measured increment, at most 3% above, prefill- and decode-bound
    batches alike."""
    import json

    from models.costs import ItemCost
    from models.hunyuan.memory import default_cost_model

    results = Path(__file__).resolve().parents[1] / "bench/results/decode_speed_h200.json"
    report = json.loads(results.read_text())
    model = default_cost_model("fast-fused")
    checked = 0
    for run in [*report["runs"], report["memory_decode"]]:
        if run.get("mode", "fast") != "fast":
            continue
        new = run["new_tokens"]
        cost = ItemCost(run["prompt_tokens"] + new, 0, 0, new_tokens=new)
        predicted = model.batch_bytes([cost] * run["batch"])
        measured = run["increment_gib"] * 1024**3
        assert measured <= predicted <= measured * 1.03, run
        checked += 1
    assert checked == 8
    # The plain path's default would over-predict the fused prefill by more than 10%.
    plain = default_cost_model("generate")
    run = next(r for r in report["runs"] if r["mode"] == "fast" and r["batch"] == 128)
    cost = ItemCost(run["prompt_tokens"] + 256, 0, 0, new_tokens=256)
    assert plain.batch_bytes([cost] * 128) > 1.1 * run["increment_gib"] * 1024**3


def test_at_most_preprocess_slots_threads_run_the_processor(
    engine: HunyuanEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many prefetch threads, at most PREPROCESS_SLOTS of them in the processor at once (the
    GIL is left to the thread that feeds the GPU), and every one of them still gets its row."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from models.hunyuan.inputs import PREPROCESS_SLOTS

    inside = 0
    most = 0
    lock = threading.Lock()
    encode = engine.preprocess_row.encode

    def counted(*args: Any) -> Any:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        try:
            time.sleep(0.02)  # long enough for the other threads to pile up at the door
            return encode(*args)
        finally:
            with lock:
                inside -= 1

    monkeypatch.setattr(engine.preprocess_row, "encode", counted)
    items = [item(64 + i, 64, 40 + i) for i in range(12)]
    with ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(engine.preprocess, items))
    assert most == PREPROCESS_SLOTS == 2
    assert all(r.positions is not None and len(r.input_ids) > 0 for r in rows)


def test_profile_key_names_the_loaded_snapshot(engine: HunyuanEngine, tmp_path: Path) -> None:
    """describe() gives the cache snapshot's commit as the revision; a plain directory keeps
    the configured one."""
    from models.hunyuan.checkpoint import snapshot_commit

    assert engine.describe()["revision"] == COMMIT
    assert snapshot_commit(engine.model_dir) == COMMIT
    assert snapshot_commit(tmp_path / "snapshots" / "abc" / "v1.0") is None  # not a cache
    assert snapshot_commit(None) is None
