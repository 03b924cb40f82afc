"""HunyuanOCR's official task prompts per model version, and the chat-templated prompt each row
starts with.

Why here and not in the wire contract: these strings are this model's, verbatim from its
release (it was trained on exactly them; Tencent's 1.5 clients refuse free-form prompts because
"hand-tweaked instructions were observed to silently degrade model quality"); another engine has
other prompts or none. The contract (`ocrq.core.contract.TASKS`) only names the tasks a job may ask
for, the union of every version's names; a job whose task is no name carries a free prompt,
which arrives here as `PreparedImage.prompt`. A name the loaded version does not offer
(`subtitles` on 1.5, `layout` on 1.0) fails its job with the list of names it does offer.

1.5's twelve prompts are Tencent's `inference/utils/tasks.py` (`TASK_PROMPTS`, Tencent-Hunyuan/
HunyuanOCR @ c55965d3), under short snake_case names: Tencent's key is given beside each, and
tests/test_hunyuan_output.py pins every string by its sha256. 1.0's six are the README's
"Application-oriented Prompts" as ocrq has always sent them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ocrq.models.base import PreparedImage, UnsupportedTask

PROMPTS_1_0: dict[str, str] = {
    "text": "提取图中的文字。",
    "spotting": "检测并识别图片中的文字，将文本坐标格式化输出。",
    "parse": (
        "提取文档图片中正文的所有信息用 markdown 格式表示，其中页眉、页脚部分忽略，"
        "表格用 html 格式表达，文档中公式用 latex 格式表示，按照阅读顺序组织进行解析。"
    ),
    "table": "把图中的表格解析为 HTML。",
    "formula": "识别图片中的公式，用 LaTeX 格式表示。",
    "subtitles": "提取图片中的字幕。",
}

PROMPTS_1_5: dict[str, str] = {
    # doc_parse: the whole page as markdown, tables as HTML, formulas as LaTeX, no header/footer.
    "parse": (
        "提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，"
        "表格用html格式表达，文档中公式用latex格式表示，按照阅读顺序组织进行解析。"
    ),
    # structured_parse: the text of non-document scenes (old prints, street views).
    "text": "提取图中的文字。",
    # spotting_json: lines as a JSON array of {"box": [x1, y1, x2, y2] in 0..1000, "text"}.
    "spotting_json": (
        "检测并识别图中所有的文字行，请按从上到下、从左到右的阅读顺序进行识别。 "
        '输出格式为 JSON 数组，每个元素必须包含："box": [xmin, ymin, xmax, ymax]'
        '（坐标需归一化到 [0, 1000] 范围内）；"text": "识别出的文字内容"。 '
        "注意：请直接输出 JSON 数组，不要包含任何多余的描述性文字。"
    ),
    # spotting_hunyuan: lines as text(x1,y1),(x2,y2), 0..1000 (1.0's spotting prompt).
    "spotting": "检测并识别图片中的文字，将文本坐标格式化输出。",
    # layout: the page's regions in reading order.
    "layout": "按照阅读顺序解析图中的版式信息。",
    # layout_parse: the whole page as markdown plus its layout.
    "layout_parse": (
        "提取文档图片中所有内容用markdown格式表示，表格用html格式表达，文档中公式用latex格式表示，"
        "请按照阅读顺序组织进行全文解析，并输出版式分析信息。"
    ),
    # chart_parse: flowcharts as Mermaid, other charts as Markdown.
    "chart": "解析图中的图表，对于流程图使用Mermaid格式表示，其他图表使用Markdown格式表示。",
    "formula": "识别图片中的公式，用LaTeX格式表示。",
    "table": "把图中的表格解析为HTML。",
    # doc_trans_en2zh: parse an (English) document, then translate it into Chinese.
    "translate_doc_zh": (
        "先解析文档，再将文档内容翻译为中文，其中页眉、页脚忽略，公式用latex格式表示，表格用html格式表示。"
    ),
    # trans_other2en / trans_other2zh: the text of any scene, translated.
    "translate_en": (
        "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，再将文字内容翻译为英文。"
    ),
    "translate_zh": (
        "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，再将文字内容翻译为中文。"
    ),
}

VERSION_PROMPTS: dict[str, dict[str, str]] = {"1.0": PROMPTS_1_0, "1.5": PROMPTS_1_5}
# Every name some version offers: what `ocrq.core.contract.TASKS` lists (a test keeps them equal).
TASK_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(name for prompts in VERSION_PROMPTS.values() for name in prompts)
)
# How each name's answer is read (ocrq/models/hunyuan/output.py); names not listed are plain text.
ANSWER_KINDS: dict[str, str] = {
    "spotting": "spotting",
    "spotting_json": "spotting_json",
    "layout": "layout",
    "parse": "parse",
    "layout_parse": "parse",
}

# Chat-template tokens around the instruction (bos, separator, image start/end, user tag, one
# spare), used only where the engine has not counted the real template with its tokenizer.
TEMPLATE_TOKENS = 6
CACHE_SIZE = 256  # templated prompts kept (free prompts are few in practice, presets a dozen)


def prompt_of(
    item: PreparedImage, prompts: Mapping[str, str] = PROMPTS_1_5, version: str = "1.5"
) -> str:
    """The instruction the model sees: the item's free prompt, else its task's prompt in
    `prompts` (the loaded `version`'s); UnsupportedTask for a name that version lacks."""
    if item.prompt:
        return item.prompt
    if item.task in prompts:
        return prompts[item.task]
    if item.task in TASK_NAMES:
        raise UnsupportedTask(
            f"task {item.task!r} is not offered by HunyuanOCR-{version}; "
            f"its tasks: {', '.join(prompts)}"
        )
    raise UnsupportedTask(f"task {item.task!r} is no preset and the item carries no prompt")


def answer_kind(item: PreparedImage, prompts: Mapping[str, str] = PROMPTS_1_5) -> str:
    """How to read the answer: by the task whose prompt the model was given, by name or spelled
    out (a free prompt equal to an official one is read as that task); else "text"."""
    prompt = prompt_of(item, prompts)
    task = item.task if item.task in prompts and not item.prompt else None
    if task is None:
        task = next((name for name, p in prompts.items() if p == prompt), None)
    return ANSWER_KINDS.get(task or "", "text")


def rough_prompt_tokens(prompt: str) -> int:
    """A conservative count of a prompt's tokens when no tokenizer is at hand.

    One token per character (a BPE token usually covers one or more characters; the official
    prompts are Chinese, about one character per token) plus the template's own tokens. Next to
    the ~1,000 image tokens of a page, an error of a few tokens here does not matter.
    """
    return len(prompt) + TEMPLATE_TOKENS


class PromptTemplates:
    """Each prompt in the model's chat template, with its token count, cached.

    Why a cache: `estimate` runs for every image in the Celery task threads and `preprocess` in
    the prefetch threads, while a job's prompt is nearly always one of a dozen presets;
    templating and tokenising it each time would cost the processor's Python for nothing.
    Thread-safe.
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self._cache: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, prompt: str) -> tuple[str, int]:
        """(templated text, its token count without the image placeholder)."""
        with self._lock:
            hit = self._cache.get(prompt)
            if hit is not None:
                self._cache.move_to_end(prompt)
                return hit
        # Tencent's message shape for both versions: an empty system message, then the image
        # before the instruction.
        messages = [
            {"role": "system", "content": ""},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
        ]
        text = self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        entry = (text, len(ids) - 1)  # the single image placeholder becomes N image tokens
        with self._lock:
            self._cache[prompt] = entry
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return entry

    def prompt_tokens(self, prompt: str) -> int:
        return self(prompt)[1]
