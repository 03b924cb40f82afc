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

from ocrq.models.base import Line
from ocrq.models.hunyuan.geometry import DEFAULT_GEOMETRY, ImageShapeError, item_cost
from ocrq.models.hunyuan.output import (
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
    result = build_result(out, task="spotting", original_size=(4000, 3000), truncated=None)
    assert result.text == "第一行\n第二行"
    assert result.lines == [
        Line("第一行", (0, 0, 2000, 300), 1.0),
        Line("第二行", (2000, 300, 4000, 600), 1.0),
    ]


def test_spotting_result_falls_back_to_raw_text() -> None:
    result = build_result("  no boxes \n", task="spotting", original_size=(10, 10), truncated=None)
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
    assert time.perf_counter() - started < 3.0  # a quadratic trim takes far longer


def test_only_cut_outputs_are_trimmed() -> None:
    # A table of contents' dot leaders end in an eos: kept. The same tail at the cap: a loop.
    toc = "Chapter 1 ........"
    assert build_result(toc, task="text", original_size=(1, 1), truncated=None).text == toc
    cut = build_result(toc, task="text", original_size=(1, 1), truncated="max_tokens")
    assert cut.text == "Chapter 1 ." and cut.truncated == "max_tokens"
    stopped = build_result(toc, task="text", original_size=(1, 1), truncated="repetition")
    assert stopped.text == "Chapter 1 ." and stopped.truncated == "repetition"
    assert build_result(toc, task="text", original_size=(1, 1)).truncated is None


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
        "from ocrq.models.base import PreparedImage\n"
        "from ocrq.models.hunyuan import HunyuanEngine\n"
        "from ocrq.core.settings import Settings\n"
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
    """The wire contract carries task names only (every version's); the engine holds each
    version's prompts, and a name the version lacks is refused by name."""
    from PIL import Image

    from ocrq.core.contract import TASKS, JobRequest
    from ocrq.models.base import PreparedImage, UnsupportedTask
    from ocrq.models.hunyuan.prompts import TASK_NAMES, VERSION_PROMPTS, answer_kind, prompt_of

    assert set(TASKS) == set(TASK_NAMES)
    image = Image.new("RGB", (8, 8))
    for version, prompts in VERSION_PROMPTS.items():
        for name in TASKS:
            request = JobRequest(image={"path": "/x.png"}, task=name)
            assert request.prompt == ""  # the engine resolves the name
            item = PreparedImage("k", image, (8, 8), task=name, prompt=request.prompt)
            if name in prompts:
                assert prompt_of(item, prompts) == prompts[name]
            else:
                with pytest.raises(UnsupportedTask, match=f"not offered by HunyuanOCR-{version}"):
                    prompt_of(item, prompts, version)
        free = JobRequest(image={"path": "/x.png"}, task="Read the line.")
        item = PreparedImage("k", image, (8, 8), task="custom", prompt=free.prompt)
        assert prompt_of(item, prompts) == "Read the line."
        assert answer_kind(item, prompts) == "text"
        # The spotting prompt spelled out is parsed as spotting too.
        spelled = PreparedImage("k", image, (8, 8), task="custom", prompt=prompts["spotting"])
        assert answer_kind(spelled, prompts) == "spotting"
    p15 = VERSION_PROMPTS["1.5"]
    kinds = {n: answer_kind(PreparedImage("k", image, (8, 8), task=n), p15) for n in p15}
    assert kinds["spotting_json"] == "spotting_json" and kinds["layout"] == "layout"
    assert kinds["parse"] == kinds["layout_parse"] == "parse" and kinds["table"] == "text"


# Tencent's 1.5 prompts (inference/utils/tasks.py @ c55965d3): sha256 of the UTF-8 bytes, first
# 16 hex digits, and length in characters, as the research notes recorded them.
PROMPT_HASHES_1_5 = {
    "parse": ("16f15a15a1eb5181", 81),  # doc_parse
    "text": ("ed471d18b8266adb", 8),  # structured_parse
    "spotting_json": ("5f5f7c04b71aa98f", 166),
    "spotting": ("9d5efb395cfbe2ab", 23),  # spotting_hunyuan
    "layout": ("7f0aead1c6dcac74", 16),
    "layout_parse": ("915ac071db0a2eec", 79),
    "chart": ("0d37a14f1b5a3320", 46),  # chart_parse
    "formula": ("4e79e42648a4252d", 20),
    "table": ("57324c7f31defb97", 14),
    "translate_doc_zh": ("bc41d6e8a350b7a0", 53),  # doc_trans_en2zh
    "translate_en": ("7781c97c9640a165", 55),  # trans_other2en
    "translate_zh": ("9d4c227aab2dc1b1", 55),  # trans_other2zh
}


def test_15_prompts_are_tencents_verbatim() -> None:
    import hashlib

    from ocrq.models.hunyuan.prompts import PROMPTS_1_5

    assert set(PROMPTS_1_5) == set(PROMPT_HASHES_1_5)
    for name, (digest, length) in PROMPT_HASHES_1_5.items():
        prompt = PROMPTS_1_5[name]
        assert (hashlib.sha256(prompt.encode()).hexdigest()[:16], len(prompt)) == (
            digest,
            length,
        ), name


def test_version_comes_from_the_config_layout_and_limits() -> None:
    from ocrq.models.hunyuan.versions import version_of_config

    flat_10 = {"hidden_size": 1024, "max_position_embeddings": 32768, "vision_config": {}}
    nested_15 = {
        "text_config": {"hidden_size": 1024, "max_position_embeddings": 131072},
        "vision_config": {"img_max_token_num": 16384, "max_vit_seq_len": 65536},
    }
    resaved_10 = {  # 1.0 saved again by transformers >= 5.13: nested, 1.0's limits
        "text_config": {"max_position_embeddings": 32768},
        "vision_config": {"img_max_token_num": 4096},
    }
    assert version_of_config(flat_10).name == "1.0"
    assert version_of_config(nested_15).name == "1.5"
    assert version_of_config(resaved_10).name == "1.0"
    assert version_of_config({"text_config": {}, "vision_config": {}}).name == "1.5"
    assert version_of_config({"hidden_size": 1024}).name == "1.0"
    flat_big = {"max_position_embeddings": 32768, "vision_config": {"max_vit_seq_len": 65536}}
    assert version_of_config(flat_big).name == "1.5"


# --- 1.5's structured answers -----------------------------------------------------------------


def test_spotting_json_answer() -> None:
    from ocrq.models.hunyuan.output import parse_spotting_json

    out = (
        '```json\n[{"box": [100, 500, 300, 540], "text": "金额(小写)"},\n'
        ' {"bbox": [[10, 20], [30, 20], [30, 40], [10, 40]], "text": "quad {x}"},\n'
        ' {"box": [1, 2, 3], "text": "bad box"}, {"box": [5, 6, 7, 8], "text": "  "},\n'
        ' {"box": [600, 900, 980, 950], "text": "cut by the ca'
    )
    assert parse_spotting_json(out) == [
        SpottedText("金额(小写)", (100, 500, 300, 540)),
        SpottedText("quad {x}", (10, 20, 30, 40)),
    ]
    result = build_result(out, task="spotting_json", original_size=(2000, 1000))
    assert result.text == "金额(小写)\nquad {x}"
    assert result.lines[0] == Line("金额(小写)", (200, 500, 600, 540), 1.0)
    junk = build_result("no json here", task="spotting_json", original_size=(10, 10))
    assert junk.text == "no json here" and junk.lines == []


def test_layout_answer_json_and_hy_meta() -> None:
    out = (
        '[{"layout_type": "title", "bbox": "(100,50),(900,50),(900,120),(100,120)", '
        '"text": "Annual report"}, {"layout_type": "figure", '
        '"bbox": [[100, 200], [900, 200], [900, 700], [100, 700]]}]'
    )
    result = build_result(out, task="layout", original_size=(1000, 2000))
    assert [(line.label, line.text, line.box) for line in result.lines] == [
        ("title", "Annual report", (100, 100, 900, 240)),
        ("figure", "", (100, 400, 900, 1400)),
    ]
    assert result.text == "Annual report"
    assert result.lines[1].as_json()["label"] == "figure"
    assert "label" not in Line("x", (0, 0, 1, 1), 1.0).as_json()  # plain lines as before
    legacy = (
        "Heading<hy-meta><layout>section_title</layout><poly>(10,10),(500,10),(500,60),"
        "(10,60)</poly></hy-meta>Body text<hy-meta><layout>paragraph</layout>"
        "<quad>(10,80),(990,400)</quad></hy-meta>"
    )
    result = build_result(legacy, task="layout", original_size=(1000, 1000))
    assert [(line.label, line.text, line.box) for line in result.lines] == [
        ("section_title", "Heading", (10, 10, 500, 60)),
        ("paragraph", "Body text", (10, 80, 990, 400)),
    ]


def test_parsed_page_figure_boxes_become_lines() -> None:
    """Captions' and figures' trailing boxes leave the markdown and become "figure" lines;
    tables and display math keep theirs; a page that is only a box (issue #118) is one."""
    out = "\n".join(
        [
            "# Title",
            "数据来源于高德地图驾车导航数据(39,337),(512,900)",
            "(147,90),(925,415)",
            "<table><tr><td>f(1,2),(3,4)</td></tr></table>",
            "$$",
            "g(1,2),(3,4)",
            "$$",
            "Text with (a), (b) in it.",
        ]
    )
    result = build_result(out, task="parse", original_size=(1000, 2000))
    assert result.text.split("\n") == [
        "# Title",
        "数据来源于高德地图驾车导航数据",
        "<table><tr><td>f(1,2),(3,4)</td></tr></table>",
        "$$",
        "g(1,2),(3,4)",
        "$$",
        "Text with (a), (b) in it.",
    ]
    assert [(line.label, line.text, line.box) for line in result.lines] == [
        ("figure", "数据来源于高德地图驾车导航数据", (39, 674, 512, 1800)),
        ("figure", "", (147, 180, 925, 830)),
    ]
    only = build_result("(156,68),(783,758)", task="parse", original_size=(1000, 1000))
    assert only.text == "" and [line.box for line in only.lines] == [(156, 68, 783, 758)]


def test_registry_is_a_mapping_and_each_engine_has_its_memory_side() -> None:
    from ocrq.core.settings import Settings
    from ocrq.models.memory import HostMemory, MemoryProbing, memory_of
    from ocrq.models.registry import ENGINES, create_engine

    assert list(ENGINES) == ["rapid", "hunyuan", "vllm", "openai"]
    with pytest.raises(ValueError, match="choose one of: rapid, hunyuan, vllm, openai"):
        create_engine("nope", Settings())
    hunyuan = create_engine("hunyuan", Settings())
    assert isinstance(hunyuan, MemoryProbing) and memory_of(hunyuan) is hunyuan
    assert hunyuan.probe_pages()[0].label == "crop-240x64"  # smallest first
    assert "decode" in hunyuan.profile_fields
    rapid = memory_of(create_engine("rapid", Settings()))  # no device: host memory
    assert isinstance(rapid, HostMemory) and rapid.profile_fields == ()
    assert rapid.is_oom(MemoryError()) and not rapid.is_oom(ValueError())


def test_rows_end_at_the_generation_configs_and_the_tokenizers_eos() -> None:
    """Both ids end a row: a 1.5 generation config may name 120020 where the tokenizer's eos
    (what Tencent's clients stop at) is 120007."""
    from types import SimpleNamespace

    from ocrq.models.hunyuan.tokens import SpecialTokens

    gen = SimpleNamespace(eos_token_id=120020, pad_token_id=None)
    tokenizer = SimpleNamespace(eos_token_id=120007, pad_token_id=120002)
    tokens = SpecialTokens.read(gen, tokenizer)
    assert tokens.eos == {120007, 120020} and tokens.pad == 120002
    kept, no_eos = tokens.cut([[5, 6, 120007, 9], [5, 120020], [5, 6]])
    assert kept == [[5, 6], [5], [5, 6]] and no_eos == [False, False, True]
    listed = SpecialTokens.read(SimpleNamespace(eos_token_id=[1, 2], pad_token_id=0), tokenizer)
    assert listed.eos == {1, 2, 120007}
