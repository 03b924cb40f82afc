"""Pure parts of the HunyuanOCR engine: output parsing, loop trimming, token arithmetic.

None of this needs torch; the estimator is checked against the real processor in
test_hunyuan_engine.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.base import Line
from models.hunyuan.geometry import DEFAULT_GEOMETRY, ImageShapeError, item_cost
from models.hunyuan.output import (
    SpottedText,
    build_result,
    parse_spotting,
    to_pixels,
    trim_repeated_tail,
)

REPO = Path(__file__).resolve().parents[1]

# --- spotting ---------------------------------------------------------------------------------


def test_spotting_items_in_order() -> None:
    out = "Hello(1,2),(3,4)World(5,6),(7,8)"
    assert parse_spotting(out) == [
        SpottedText("Hello", (1, 2, 3, 4)),
        SpottedText("World", (5, 6, 7, 8)),
    ]


def test_spotting_real_shaped_answer() -> None:
    # Newline-separated items, CJK text, parentheses inside the text, spaces after commas.
    out = (
        "发票代码(120,45),(380,80)\n"
        "金额(小写)(100,500),(300,540)\n"
        "ATLANTA (AP) wire(12,34), (56,78)\n"
        "TOTAL 134.90(600,900),(980,950)"
    )
    items = parse_spotting(out)
    texts = ["发票代码", "金额(小写)", "ATLANTA (AP) wire", "TOTAL 134.90"]
    assert [i.text for i in items] == texts
    assert items[2].box == (12, 34, 56, 78)


def test_spotting_extra_pairs_and_unfinished_tail_are_dropped() -> None:
    out = "Hello(1,2),(3,4),(5,6),(7,8)next(10,20),(30,4"
    assert parse_spotting(out) == [SpottedText("Hello", (1, 2, 3, 4))]


def test_spotting_digits_in_parentheses_are_text() -> None:
    # "(1,2)" alone is not a box: a box is two pairs joined by a comma.
    expected = [SpottedText("f(1,2) = 3", (10, 20, 30, 40))]
    assert parse_spotting("f(1,2) = 3(10,20),(30,40)") == expected


def test_spotting_without_boxes_parses_to_nothing() -> None:
    assert parse_spotting("just some text") == []
    assert parse_spotting("") == []


def test_boxes_map_to_original_pixels() -> None:
    # Normalised 0..1000 of whatever the model saw -> pixels of the original image.
    assert to_pixels((100, 500, 300, 540), (2000, 1000)) == (200, 500, 600, 540)
    # Corners come back ordered and clamped to the image.
    assert to_pixels((900, 700, 100, 1200), (1000, 500)) == (100, 350, 900, 500)


def test_spotting_result_uses_original_size() -> None:
    out = "第一行(0,0),(500,100)\n第二行(500,100),(1000,200)"
    result = build_result(out, task="spotting", original_size=(4000, 3000), capped=False)
    assert result.text == "第一行\n第二行"
    assert result.lines == [
        Line("第一行", (0, 0, 2000, 300), 1.0),
        Line("第二行", (2000, 300, 4000, 600), 1.0),
    ]


def test_spotting_result_falls_back_to_raw_text() -> None:
    result = build_result("  no boxes \n", task="spotting", original_size=(10, 10), capped=False)
    assert result.text == "no boxes"
    assert result.lines == []


# --- repeated tails ---------------------------------------------------------------------------


def test_trim_keeps_one_copy_of_the_loop() -> None:
    assert trim_repeated_tail("abcabcabcabc") == "abc"
    # The loop may start mid-unit: here the unit is "\n| a | b |".
    assert trim_repeated_tail("Total: 12\n" + "| a | b |\n" * 30) == "Total: 12\n| a | b |"
    assert trim_repeated_tail("aaaaaaaa") == "a"


def test_trim_handles_a_unit_cut_by_the_cap() -> None:
    assert trim_repeated_tail("xyz" + "abc" * 5 + "ab") == "xyzabc"


def test_trim_leaves_text_without_a_loop() -> None:
    text = "提取图中的文字。第一行，第二行。"
    assert trim_repeated_tail(text) == text
    assert trim_repeated_tail("ababab") == "ababab"  # three copies: below min_repeats=4
    assert trim_repeated_tail("") == ""


def test_trim_cjk_loop() -> None:
    text = "发票号码：123\n" + "重复的内容。" * 40 + "重复"
    assert trim_repeated_tail(text) == "发票号码：123\n重复的内容。"


def test_trim_is_fast_on_long_loops() -> None:
    text = "header\n" + "0123456789abcdef" * 2000  # ~32k characters, as a 8k-token cap can give
    started = time.perf_counter()
    assert trim_repeated_tail(text) == "header\n0123456789abcdef"
    assert time.perf_counter() - started < 1.0


def test_only_capped_outputs_are_trimmed() -> None:
    # A table of contents' dot leaders end in an eos: kept. The same tail at the cap: a loop.
    toc = "Chapter 1 ........"
    assert build_result(toc, task="text", original_size=(1, 1), capped=False).text == toc
    assert build_result(toc, task="text", original_size=(1, 1), capped=True).text == "Chapter 1 ."


# --- token arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "resized", "tokens", "patches"),
    [
        ((1024, 1024), (1024, 1024), 32 * 33 + 2, 64 * 64),
        ((886, 1699), (896, 1696), 53 * 29 + 2, 56 * 106),  # receipt
        ((1248, 1760), (1248, 1760), 55 * 40 + 2, 78 * 110),  # A4 at 150 dpi
        ((10, 10), (512, 512), 16 * 17 + 2, 32 * 32),  # tiny: scaled up to 512²
        ((8000, 8000), (2048, 2048), 64 * 65 + 2, 128 * 128),  # huge: scaled down to 2048²
    ],
)
def test_estimator_known_sizes(
    size: tuple[int, int], resized: tuple[int, int], tokens: int, patches: int
) -> None:
    assert DEFAULT_GEOMETRY.resized(*size) == resized
    assert DEFAULT_GEOMETRY.image_tokens(*size) == tokens
    assert DEFAULT_GEOMETRY.vit_patches(*size) == patches
    cost = item_cost(*size, prompt_tokens=15, max_new_tokens=256)
    assert cost.tokens == 15 + tokens + 256
    assert cost.patches == patches
    assert cost.pixels == resized[0] * resized[1]


def test_estimator_refuses_extreme_aspect() -> None:
    DEFAULT_GEOMETRY.resized(4000, 20)  # 200:1 is still accepted
    with pytest.raises(ImageShapeError, match="aspect ratio"):
        DEFAULT_GEOMETRY.resized(4020, 20)


def test_cpu_path_never_imports_torch() -> None:
    """The planner side (estimator, parser, engine construction, estimate) runs without torch."""
    code = (
        "import sys\n"
        "from PIL import Image\n"
        "from models.base import PreparedImage\n"
        "from models.hunyuan import HunyuanEngine\n"
        "from ocrq.settings import Settings\n"
        "engine = HunyuanEngine(Settings())\n"
        "img = Image.new('RGB', (886, 1699))\n"
        "cost = engine.estimate(PreparedImage('k', img, img.size, task='spotting'))\n"
        "assert cost.tokens > 1539, cost\n"
        "engine.cost_model()\n"
        "bad = [m for m in ('torch', 'transformers', 'torchvision') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# --- prompts, registry, the optional memory side ----------------------------------------------


def test_named_tasks_get_the_engines_prompt_and_free_prompts_pass_through() -> None:
    """The wire contract carries task names only; the engine holds HunyuanOCR's prompts."""
    from PIL import Image

    from models.base import PreparedImage
    from models.hunyuan.prompts import TASK_PRESETS, answer_kind, prompt_of
    from ocrq.contract import TASKS, JobRequest

    assert set(TASKS) == set(TASK_PRESETS)
    image = Image.new("RGB", (8, 8))
    for name in TASKS:
        request = JobRequest(image={"path": "/x.png"}, task=name)
        assert request.prompt == ""  # the engine resolves the name
        item = PreparedImage("k", image, (8, 8), task=name, prompt=request.prompt)
        assert prompt_of(item) == TASK_PRESETS[name]
    free = JobRequest(image={"path": "/x.png"}, task="Read the line.")
    item = PreparedImage("k", image, (8, 8), task="custom", prompt=free.prompt)
    assert prompt_of(item) == "Read the line." and answer_kind(item) == "custom"
    # The spotting prompt spelled out is parsed as spotting too.
    spelled = PreparedImage("k", image, (8, 8), task="custom", prompt=TASK_PRESETS["spotting"])
    assert answer_kind(spelled) == "spotting"


def test_registry_is_a_mapping_and_each_engine_has_its_memory_side() -> None:
    from models.memory import HostMemory, MemoryProbing, memory_of
    from models.registry import ENGINES, create_engine
    from ocrq.settings import Settings

    assert list(ENGINES) == ["rapid", "hunyuan"]
    with pytest.raises(ValueError, match="choose one of: rapid, hunyuan"):
        create_engine("nope", Settings())
    hunyuan = create_engine("hunyuan", Settings())
    assert isinstance(hunyuan, MemoryProbing) and memory_of(hunyuan) is hunyuan
    assert hunyuan.probe_pages()[0].label == "crop-240x64"  # smallest first
    assert "decode" in hunyuan.profile_fields
    rapid = memory_of(create_engine("rapid", Settings()))  # no device: host memory
    assert isinstance(rapid, HostMemory) and rapid.profile_fields == ()
    assert rapid.is_oom(MemoryError()) and not rapid.is_oom(ValueError())
