"""HunyuanOCR's official task prompts, and the chat-templated prompt each row starts with.

Why here and not in the wire contract: these strings are this model's, verbatim from its
release (it was trained on exactly them); another engine has other prompts or none. The contract
(`ocrq.contract.TASKS`) only names the tasks a job may ask for; a job whose task is no name
carries a free prompt, which arrives here as `PreparedImage.prompt`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from models.base import PreparedImage, UnsupportedTask

TASK_PRESETS: dict[str, str] = {
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

# Chat-template tokens around the instruction (bos, separator, image start/end, user tag, one
# spare), used only where the engine has not counted the real template with its tokenizer.
TEMPLATE_TOKENS = 6
CACHE_SIZE = 256  # templated prompts kept (free prompts are few in practice, presets six)


def prompt_of(item: PreparedImage) -> str:
    """The instruction the model sees: the item's free prompt, else its task's preset."""
    if item.prompt:
        return item.prompt
    if item.task in TASK_PRESETS:
        return TASK_PRESETS[item.task]
    raise UnsupportedTask(f"task {item.task!r} is no preset and the item carries no prompt")


def answer_kind(item: PreparedImage) -> str:
    """How to read the answer: "spotting" (boxed lines) whenever the model was asked the
    spotting prompt, by name or spelled out; else the item's task."""
    return "spotting" if prompt_of(item) == TASK_PRESETS["spotting"] else item.task


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
    the prefetch threads, while a job's prompt is nearly always one of six presets; templating
    and tokenising it each time would cost the processor's Python for nothing. Thread-safe.
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
