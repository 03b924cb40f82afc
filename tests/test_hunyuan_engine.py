"""HunyuanEngine on tiny random HunYuanVLs, loaded through the same path as the real checkpoints.

The checkpoints are written at test time (ocrq/testing/tiny_hunyuan.py) into a fake Hugging Face
cache
as tencent/HunyuanOCR, revision main: a 1.5 (nested config, 1.5's limits) at the root, as the
real repository has since July 2026, and a 1.0 (flat config) under v1.0/. The engine loads them
by that id with HF_HUB_OFFLINE=1: the code path a worker takes in production. Most tests run on
both versions.

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

from ocrq.core.settings import Settings
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.hunyuan import HunyuanEngine, ModelNotFound
from ocrq.models.hunyuan.checkpoint import resolve_model_dir
from ocrq.models.hunyuan.generation import Generated
from ocrq.models.hunyuan.geometry import ImageGeometry, ImageShapeError
from ocrq.models.hunyuan.inputs import collate
from ocrq.models.hunyuan.prompts import PROMPTS_1_0, VERSION_PROMPTS
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

SUBFOLDER = {"1.0": "v1.0", "1.5": None}  # where each version lives in the repository
MAX_PIXELS = {"1.0": 160 * 160, "1.5": 192 * 192}  # the tiny processors' limits

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
def engines(hf_cache: Path) -> dict[str, HunyuanEngine]:
    """Both versions, each loaded once for the module."""
    loaded = {}
    for version, subfolder in SUBFOLDER.items():
        eng = HunyuanEngine.from_settings(cpu_settings(MODEL_ID, MAX_NEW, subfolder=subfolder))
        eng.load()
        loaded[version] = eng
    return loaded


@pytest.fixture(scope="module", params=["1.0", "1.5"])
def engine(engines: dict[str, HunyuanEngine], request: pytest.FixtureRequest) -> HunyuanEngine:
    return engines[request.param]


@pytest.fixture(scope="module")
def engine10(engines: dict[str, HunyuanEngine]) -> HunyuanEngine:
    """For the checks one version shows as well as two."""
    return engines["1.0"]


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
    version = engine.version.name
    snapshot = hf_cache / f"models--tencent--HunyuanOCR/snapshots/{COMMIT}"
    assert engine.model_dir == (snapshot / "v1.0" if version == "1.0" else snapshot)
    assert engine.model.config._attn_implementation == "sdpa"
    assert engine.processor.tokenizer.padding_side == "left"
    # Each version's limit comes from its own processor.
    assert engine.geometry == ImageGeometry(min_pixels=64 * 64, max_pixels=MAX_PIXELS[version])
    assert engine.model_limit == MAX_PIXELS[version]


def test_version_comes_from_the_checkpoints_config(hf_cache: Path, engine: HunyuanEngine) -> None:
    """The default settings load the repository's root, 1.5; v1.0/ holds 1.0; each brings its
    prompts and Tencent's repetition penalty (1.08 for 1.5, none for 1.0), and says which it is
    in the facts that key a tuned profile."""
    import json

    flat = "text_config" not in json.loads((engine.model_dir / "config.json").read_text())
    assert engine.version.name == ("1.0" if flat else "1.5")
    assert Settings().model_subfolder is None
    assert engine.version.prompts is VERSION_PROMPTS[engine.version.name]
    want = {"1.0": 1.0, "1.5": 1.08}[engine.version.name]
    assert engine.repetition_penalty == want
    assert engine._generation_config.repetition_penalty == want
    assert engine.describe()["version"] == engine.version.name
    assert "version" in engine.profile_fields
    # The 1.5 text config was written nested, the 1.0 one flat with its legacy names, and
    # transformers reads both into the same model.
    cfg = engine.model.config.text_config
    assert (cfg.vocab_size, cfg.head_dim, cfg.rope_parameters["mrope_section"]) == (
        320,
        16,
        [2, 2, 2, 2],
    )


def test_every_task_of_the_version_runs(engine: HunyuanEngine) -> None:
    """Every name the loaded version offers gives a result; a name only the other version
    offers fails that job alone, naming what this one offers; free prompts still work."""
    own = list(engine.version.prompts)
    other = sorted((set(VERSION_PROMPTS["1.0"]) ^ set(VERSION_PROMPTS["1.5"])) - set(own))
    assert other  # 1.5 lacks subtitles, 1.0 lacks layout, spotting_json, ...
    batch = [item(100, 80, i, task=t) for i, t in enumerate(own)]
    batch += [item(100, 80, 50, task=other[0])]
    batch += [item(100, 80, 51, task="custom", prompt="Read the line.")]
    results = engine.run(batch)
    assert all(isinstance(r, OcrResult) for r in results[: len(own)]), results
    assert isinstance(results[-2], ValueError)
    want = f"task {other[0]!r} is not offered by HunyuanOCR-{engine.version.name}"
    assert want in str(results[-2])
    assert ", ".join(own) in str(results[-2])
    assert isinstance(results[-1], OcrResult)
    with pytest.raises(ValueError, match="not offered"):
        engine.estimate(batch[-2])  # the batcher fails it before it waits for a batch


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
    engine10: HunyuanEngine, size: tuple[int, int]
) -> None:
    """With 1.0's limits (512²..2048²): tokens and patches as the real processor counts."""
    from ocrq.models.hunyuan.geometry import DEFAULT_GEOMETRY

    assert_estimate_is_the_processors(engine10, DEFAULT_GEOMETRY, size)


@pytest.mark.parametrize("size", [(1248, 1760), (2480, 3508), (4961, 7016), (20, 3000)])
def test_estimator_matches_the_processor_at_15s_limit(
    engine10: HunyuanEngine, size: tuple[int, int]
) -> None:
    """With 1.5's limit (~4096²), A4 at 300 dpi among them: 8,692 image tokens unshrunk."""
    from ocrq.models.hunyuan.geometry import DEFAULT_GEOMETRY

    geometry = ImageGeometry(max_pixels=4096 * 4096)
    assert_estimate_is_the_processors(engine10, geometry, size)
    if size == (2480, 3508):
        assert geometry.resized(*size) == (2496, 3520)
        assert geometry.image_tokens(*size) == 110 * 79 + 2
        assert DEFAULT_GEOMETRY.image_tokens(*size) < geometry.image_tokens(*size) / 2


def assert_estimate_is_the_processors(
    engine: HunyuanEngine, geometry: ImageGeometry, size: tuple[int, int]
) -> None:
    from transformers import HunYuanVLImageProcessor, HunYuanVLProcessor

    processor = HunYuanVLProcessor(
        image_processor=HunYuanVLImageProcessor(
            size={"shortest_edge": geometry.min_pixels, "longest_edge": geometry.max_pixels}
        ),
        tokenizer=engine.processor.tokenizer,
        chat_template=engine.processor.chat_template,
    )
    text, prompt_tokens = engine.templates(PROMPTS_1_0["text"])
    enc = processor(text=[text], images=[Image.new("RGB", size, "white")], return_tensors="pt")
    assert geometry.image_tokens(*size) == enc["input_ids"].shape[1] - prompt_tokens
    assert geometry.vit_patches(*size) == enc["pixel_values"].shape[0]
    assert int((enc["mm_token_type_ids"] == 1).sum()) == geometry.image_tokens(*size)


def test_processor_and_estimator_refuse_the_same_aspect(engine10: HunyuanEngine) -> None:
    img = Image.new("RGB", (4020, 20), "white")
    with pytest.raises(ValueError, match="aspect ratio"):
        engine10.processor.image_processor(images=[img])
    with pytest.raises(ImageShapeError):
        engine10.estimate(PreparedImage("wide", img, img.size))


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


def test_missing_root_model_says_how_to_fetch_15(hf_cache: Path) -> None:
    """The default (the repository's root, 1.5): the command skips the archived 1.0 and the
    draft model, as Tencent's own does."""
    with pytest.raises(ModelNotFound) as err:
        resolve_model_dir(MODEL_ID, "feedbeef", None)
    want = "hf download tencent/HunyuanOCR --revision feedbeef --exclude 'v1.0/*' --exclude"
    assert want in str(err.value) and "'dflash/*'" in str(err.value)
    assert "subfolder (root)" in str(err.value)


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


def test_local_directory_with_and_without_subfolder(engine10: HunyuanEngine) -> None:
    ckpt = engine10.model_dir
    assert ckpt is not None
    assert resolve_model_dir(str(ckpt.parent), None, "v1.0") == ckpt
    assert resolve_model_dir(str(ckpt), None, "v1.0") == ckpt  # pointed at the folder itself


def test_eager_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="eager"):
        HunyuanEngine(Settings(attention="eager"))


def test_default_cost_model_covers_the_h200_measurements() -> None:
    """The default model never predicts less than the benchmark measured, nor 5% more."""
    import json

    results = (
        Path(__file__).resolve().parents[1]
        / "bench/results/hunyuan_engine_bench/hunyuan_engine_h200.json"
    )
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
    from ocrq.models.hunyuan.memory import cache_token_bytes

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

    from ocrq.models.costs import ItemCost
    from ocrq.models.hunyuan.memory import default_cost_model

    results = (
        Path(__file__).resolve().parents[1] / "bench/results/decode_speed/decode_speed_h200.json"
    )
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


@pytest.mark.parametrize("mode", ["processor", "tensor"])
def test_at_most_preprocess_slots_threads_run_the_processor(
    engine10: HunyuanEngine, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Many prefetch threads, at most PREPROCESS_SLOTS of them in the processor at once (the
    GIL is left to the thread that feeds the GPU), at most a core's worth in the tensor path
    (its ops release the GIL), and every one of them still gets its row."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ocrq.models.hunyuan.inputs import PREPROCESS_SLOTS, Preprocessor, tensor_slots

    row = engine10.preprocess_row
    assert row is not None and row.mode == "tensor"  # the default
    preprocessor = Preprocessor(
        row.model,
        row.processor,
        row.templates,
        row.geometry,
        pin=False,
        prompt_for=row.prompt_for,
        cap_of=row.cap_of,
        mode=mode,
    )
    limit = PREPROCESS_SLOTS if mode == "processor" else tensor_slots()
    assert preprocessor.limit == limit

    inside = 0
    most = 0
    lock = threading.Lock()
    encode = preprocessor.encode

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

    monkeypatch.setattr(preprocessor, "encode", counted)
    items = [item(64 + i, 64, 40 + i) for i in range(limit + 12)]
    with ThreadPoolExecutor(limit + 6) as pool:
        rows = list(pool.map(preprocessor, items))
    assert most == limit
    assert PREPROCESS_SLOTS == 2
    assert all(r.positions is not None and len(r.input_ids) > 0 for r in rows)


def test_profile_key_names_the_loaded_snapshot(engine: HunyuanEngine, tmp_path: Path) -> None:
    """describe() gives the cache snapshot's commit as the revision; a plain directory keeps
    the configured one."""
    from ocrq.models.hunyuan.checkpoint import snapshot_commit

    assert engine.describe()["revision"] == COMMIT
    assert snapshot_commit(engine.model_dir) == COMMIT
    assert snapshot_commit(tmp_path / "snapshots" / "abc" / "v1.0") is None  # not a cache
    assert snapshot_commit(None) is None


# --- resolution presets -----------------------------------------------------------------------


def test_presets_cap_the_pixels_the_model_sees(
    engines: dict[str, HunyuanEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's own cap, a worker's override and a task's preset each shrink what the model
    sees, always within the model's limits; the estimate counts the shrunk image exactly as the
    processor then encodes it (so the planner plans for it), and prepare() keeps only that."""
    engine = engines["1.5"]
    size = (190, 190)  # under the tiny 1.5's limit (192²), over the caps below
    model_max, model_min = 192 * 192, 64 * 64
    cases = [
        # (task, free prompt, the job's cap, the worker's overrides, pixels allowed)
        ("parse", "", 100 * 100, {}, 100 * 100),
        ("table", "", None, {"table": 120 * 120}, 120 * 120),
        ("table", "", 90 * 90, {"table": 120 * 120}, 90 * 90),  # the job's own wins
        ("parse", "", None, {}, model_max),  # the 1536² preset is over this model's limit
        ("custom", "提取图片中的字幕。", None, {}, model_max),  # free prompts: no preset
        ("custom", "x", 10**8, {}, model_max),  # never above the model's limit
        ("parse", "", 10, {}, model_min),  # nor below its minimum
    ]
    for task, prompt, job_cap, overrides, allowed in cases:
        settings = engine.settings.model_copy(update={"task_max_pixels": overrides})
        monkeypatch.setattr(engine, "settings", settings)
        it = item(*size, 3, task=task, prompt=prompt, job_cap=job_cap)
        case = (task, job_cap, overrides)
        assert engine.view_pixels(it) == allowed, case
        cost = engine.estimate(it)
        row = engine.preprocess(it)
        assert cost.patches == row.pixel_values.shape[0], case
        assert cost.tokens == len(row.input_ids) + MAX_NEW, case
        assert cost.pixels <= allowed, case
        if allowed < model_max:
            assert cost.pixels > allowed / 4, case  # to the cap, within the 32-pixel grid
        engine.prepare(it)
        assert it.image.size[0] * it.image.size[1] <= allowed, case
        assert engine.estimate(it) == cost, case  # the shrunk image costs what was planned
        assert it.original_size == size  # boxes still map to the job's own pixels


def test_presets_default_by_task_and_the_settings_row() -> None:
    """Documents 1536², scene text 2048², subtitles and free prompts the model's limit; an A4
    page at 300 dpi under 1.5 is shrunk to the document preset for parse (2,339 image tokens
    where its full size gives 8,692), and OCRQ_TASK_MAX_PIXELS is typed and bounded."""
    from pydantic import ValidationError

    from ocrq.core.contract import TASKS
    from ocrq.models.hunyuan.resolution import TASK_MAX_PIXELS

    eng = HunyuanEngine(Settings())  # before loading: 1.5's limit
    a4 = (2480, 3508)
    parse = PreparedImage("p", Image.new("RGB", a4), a4, task="parse")
    spot = PreparedImage("s", Image.new("RGB", a4), a4, task="spotting")
    assert eng.view_pixels(parse) == 1536 * 1536 and eng.view_pixels(spot) == 2048 * 2048
    assert eng.estimate(parse).pixels == 1280 * 1824
    assert eng.estimate(parse).prompt_tokens - 57 * 41 - 2 < 200
    assert eng.estimate(spot).pixels == 1696 * 2432
    assert set(TASK_MAX_PIXELS) < set(TASKS)
    assert Settings(task_max_pixels="parse=4194304").task_max_pixels == {"parse": 4194304}
    for bad in ("parse=5", "nosuch=4194304", "parse"):
        with pytest.raises(ValidationError):
            Settings(task_max_pixels=bad)


def test_planner_downscales_the_biggest_15_pages_over_budget() -> None:
    """The estimate grows with the pixels 1.5 accepts (a 4096² page is 16,514 image tokens),
    and a budget that one such page exceeds makes the batcher shrink it until it fits, never
    sending it into an out-of-memory error."""
    from ocrq.models.costs import GiB
    from ocrq.scheduling.batcher import StaticBatcher as Batcher
    from ocrq.scheduling.vocabulary import BatchConfig

    eng = HunyuanEngine(Settings(max_new_tokens=16))
    huge = PreparedImage(
        "h", Image.new("RGB", (4096, 4096)), (4096, 4096), task="custom", prompt="x"
    )
    cost = eng.estimate(huge)
    assert cost.prompt_tokens >= 128 * 129 + 2 and cost.patches == 256 * 256
    model = eng.cost_model()
    one = model.batch_bytes([cost])
    assert one > 2 * GiB  # 16.5k tokens at 139-162 KiB each

    shrunk: list[tuple[int, int]] = []

    class Recording(HunyuanEngine):
        def run(self, batch: Any) -> list[Any]:
            shrunk.extend(it.image.size for it in batch)
            return [OcrResult(text="") for _ in batch]

    rec = Recording(Settings(max_new_tokens=16))
    batcher = Batcher(rec, BatchConfig(max_items=4, wait_s=0.01, budget_bytes=one // 3)).start()
    try:
        outcome = batcher.submit(huge).result(timeout=60)
    finally:
        batcher.stop()
    assert outcome.error is None
    assert shrunk and shrunk[0][0] * shrunk[0][1] <= 4096 * 4096 // 2
    small = PreparedImage("s", Image.new("RGB", shrunk[0]), shrunk[0], task="custom", prompt="x")
    assert model.batch_bytes([rec.estimate(small)]) <= one // 3
    assert huge.image.size == (4096, 4096)  # the submitted item is left alone


def test_the_registry_builds_the_loop_engine_only_where_the_scheduler_asks_for_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OCRQ_SCHEDULER picks the class once, before loading: the running loop's engine (a
    StreamingEngine) for "continuous" on the fast decode path, and for "auto" where the loop's
    decode attention is Triton's; the static engine otherwise. `streaming` answers the same."""
    from ocrq.models import base
    from ocrq.models.hunyuan import HunyuanLoopEngine, runs_loop
    from ocrq.models.hunyuan import attention as attention_module
    from ocrq.models.registry import create_engine

    cases = [
        ({"scheduler": "continuous"}, HunyuanLoopEngine),
        ({"scheduler": "static"}, HunyuanEngine),
        ({"scheduler": "continuous", "decode": "generate"}, HunyuanEngine),
        ({"scheduler": "auto", "device": "cpu"}, HunyuanEngine),  # the torch attention
        ({"scheduler": "auto", "decode_attention": "triton"}, HunyuanLoopEngine),
        ({"scheduler": "auto", "decode_attention": "torch"}, HunyuanEngine),
    ]
    for fields, want in cases:
        engine = create_engine("hunyuan", Settings(**fields))
        assert type(engine) is want, fields
        assert (base.streaming(engine) is engine) == (want is HunyuanLoopEngine), fields
    # "auto" on a CUDA device takes the loop only where Triton is installed.
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = Settings(scheduler="auto", device="cuda:0").hunyuan
    monkeypatch.setattr(attention_module, "triton_available", lambda: True)
    assert runs_loop(cuda)
    monkeypatch.setattr(attention_module, "triton_available", lambda: False)
    assert not runs_loop(cuda)
    with pytest.raises(ValueError, match="fast decode path"):
        HunyuanLoopEngine(Settings(), decode="generate")
