"""Random-weight HunYuanVL checkpoints on disk, laid out like tencent/HunyuanOCR (1.0 and 1.5):
for tests and benchmarks, never used in production.

Why: CI has no GPU and no weights, and the benchmark must not depend on a download either. Both
need a checkpoint directory that the engine loads through exactly the code path a real one takes
(`HunyuanEngine.load` -> AutoProcessor / HunYuanVLForConditionalGeneration, local files only).
So this module writes one: a HunYuanVLConfig, random weights, a word-level `tokenizers` tokenizer
that exposes the image start/image/image end/pad tokens the processor requires, the real
HunYuanVL image processor and processor, a chat template of the real one's shape, and a
generation config. `TINY` (1.0) and `TINY_1_5` are few-dimensional models for the unit tests;
`TINY_VLLM_SHAPES` the same with head_dim 32 (vLLM's CPU attention needs it);
`HUNYUAN_OCR_1_0` and `HUNYUAN_OCR_1_5` have the full shape (text 1024 x 24 layers, 16 heads /
8 KV heads, head_dim 128, vocab 120818; vision 1152 x 27 layers, patch 16, merge 2) for the GPU
benchmarks. A 1.0 checkpoint's config.json is written flat, with 1.0's legacy key names, as the
released 1.0 is; a 1.5 one nested, with 1.5's limits (ocrq/models/hunyuan/versions.py tells them
apart by exactly that).

`ForcedLoop` makes chosen rows of a batch emit a fixed cycle of tokens: the repetition guard's
tests and benchmark need rows that loop, which a random model does not do on demand.

The tokenizer splits text into single characters and knows the characters of every official
prompt, so prompts tokenise without unknowns. Token ids of the image tokens and the pad token are
the real checkpoint's in the full shape; the names and ids of bos/eos/the role tokens are
stand-ins (their exact values do not change any cost or shape).

Imported by tests and by the benchmarks (bench/common.py); building needs torch + transformers.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ocrq.models.hunyuan.prompts import VERSION_PROMPTS
from ocrq.models.hunyuan.versions import V1_0_LIMITS, V1_5_LIMITS

IMAGE_START = "<｜hy_place▁holder▁no▁100｜>"
IMAGE_END = "<｜hy_place▁holder▁no▁101｜>"
IMAGE = "<｜hy_place▁holder▁no▁102｜>"
PAD = "<｜hy_▁pad▁｜>"
BOS = "<｜hy_begin▁of▁sentence｜>"
EOS = "<｜hy_place▁holder▁no▁2｜>"
SYSTEM_END = "<｜hy_place▁holder▁no▁3｜>"
USER = "<｜hy_User｜>"
ASSISTANT = "<｜hy_Assistant｜>"
UNK = "<｜hy_unk｜>"

# Same shape as the official template: bos, system text, a separator, the user's content
# (image placeholder wrapped in start/end tokens, then the instruction) and the user tag that
# opens the model's turn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    # A system message's content as a string, or as text parts: vLLM's OpenAI server hands the
    # template parts (Tencent's clients send an empty system message through it).
    "{%- for m in messages if m['role'] == 'system' -%}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}"
    "{%- else -%}{%- for c in m['content'] if c['type'] == 'text' -%}{{- c['text'] -}}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{{- '" + SYSTEM_END + "' -}}"
    "{%- for m in messages if m['role'] != 'system' -%}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}"
    "{%- else -%}{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' -%}"
    "{{- '" + IMAGE_START + IMAGE + IMAGE_END + "' -}}"
    "{%- elif c['type'] == 'text' -%}{{- c['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if m['role'] == 'user' -%}{{- '" + USER + "' -}}"
    "{%- else -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class Shape:
    """Model dimensions plus the ids of the special tokens in the embedding table."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mrope_section: tuple[int, ...]
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_layers: int
    vision_heads: int
    max_image_size: int
    special_ids: dict[str, int] = field(default_factory=dict)
    min_pixels: int = 512 * 512
    max_pixels: int = 2048 * 2048
    initializer_range: float = 0.02
    version: str = "1.0"  # "1.0": a flat config.json; "1.5": nested, with 1.5's limits


TINY = Shape(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mrope_section=(2, 2, 2, 2),
    vision_hidden_size=32,
    vision_intermediate_size=64,
    vision_layers=1,
    vision_heads=2,
    max_image_size=512,
    special_ids={
        UNK: 0,
        PAD: 1,
        BOS: 2,
        EOS: 3,
        SYSTEM_END: 4,
        USER: 5,
        ASSISTANT: 6,
        IMAGE_START: 7,
        IMAGE_END: 8,
        IMAGE: 9,
    },
    # Small images keep the CPU tests fast; the engine reads these limits from the processor.
    min_pixels=64 * 64,
    max_pixels=160 * 160,
    # Larger random weights so different images move the logits visibly.
    initializer_range=0.2,
)

HUNYUAN_OCR_1_0 = Shape(
    vocab_size=120818,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    mrope_section=(16, 16, 16, 16),
    vision_hidden_size=1152,
    vision_intermediate_size=4304,
    vision_layers=27,
    vision_heads=16,
    max_image_size=2048,
    special_ids={
        UNK: 120000,
        PAD: 120002,
        BOS: 120000 + 6,
        EOS: 120020,
        SYSTEM_END: 120021,
        USER: 120006 + 1,
        ASSISTANT: 120006 + 2,
        IMAGE_START: 120118,
        IMAGE_END: 120119,
        IMAGE: 120120,
    },
)


# 1.5: the same backbone, a nested config with larger limits, ~4096² pixels (ocrq/models/hunyuan/
# versions.py). The tiny one takes a little more than the tiny 1.0, so that tests see the engine
# read each processor's own limit.
TINY_1_5 = replace(TINY, version="1.5", max_pixels=192 * 192)
HUNYUAN_OCR_1_5 = replace(HUNYUAN_OCR_1_0, version="1.5", max_pixels=4096 * 4096)
SHAPES = {"1.0": HUNYUAN_OCR_1_0, "1.5": HUNYUAN_OCR_1_5}
TINY_SHAPES = {"1.0": TINY, "1.5": TINY_1_5}
# For vLLM (ocrq/models/vllm): its CPU attention needs head_dim >= 32, so these tiny models
# take 32 (and mrope sections that add up to half of it); otherwise the same as TINY / TINY_1_5.
TINY_VLLM_SHAPES = {
    v: replace(shape, head_dim=32, mrope_section=(4, 4, 4, 4)) for v, shape in TINY_SHAPES.items()
}

# The limits each version's config states (text max_position_embeddings; vision token limits).
LIMITS = {"1.0": V1_0_LIMITS, "1.5": V1_5_LIMITS}


def _vocab(shape: Shape) -> dict[str, int]:
    """Special tokens at their ids, then every prompt character and printable ASCII."""
    vocab = dict(shape.special_ids)
    prompts = "".join(p for ps in VERSION_PROMPTS.values() for p in ps.values())
    chars = sorted(set(prompts) | set(string.printable) | {"（", "）"})
    next_id = 0
    taken = set(vocab.values())
    for ch in chars:
        while next_id in taken:
            next_id += 1
        vocab[ch] = next_id
        taken.add(next_id)
    if max(vocab.values()) >= shape.vocab_size:
        raise ValueError(f"vocab of {len(vocab)} tokens does not fit vocab_size={shape.vocab_size}")
    return vocab


def build_tokenizer(shape: Shape):  # -> PreTrainedTokenizerFast
    """A character-level tokenizer that exposes the named image tokens HunYuanVLProcessor needs."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=_vocab(shape), unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Registered on the backend so the pre-tokenizer never splits them into characters.
    backend.add_special_tokens([AddedToken(t, special=True) for t in shape.special_ids])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens={
            "image_token": IMAGE,
            "image_start_token": IMAGE_START,
            "image_end_token": IMAGE_END,
        },
        chat_template=CHAT_TEMPLATE,
    )


def build_config(shape: Shape):  # -> HunYuanVLConfig
    from transformers import HunYuanVLConfig

    ids = shape.special_ids
    limits = LIMITS[shape.version]
    text = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": limits["max_position_embeddings"],
        "initializer_range": shape.initializer_range,
        "tie_word_embeddings": True,
        "pad_token_id": ids[PAD],
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        # The checkpoints' own spelling; the config maps it onto mrope_section / ntk-alpha.
        "rope_parameters": {
            "rope_type": "xdrope",
            "rope_theta": 10000.0,
            "alpha": 1000.0,
            "factor": 1.0,
            "xdrope_section": list(shape.mrope_section),
        },
    }
    vision = {
        "hidden_size": shape.vision_hidden_size,
        "intermediate_size": shape.vision_intermediate_size,
        "num_hidden_layers": shape.vision_layers,
        "num_attention_heads": shape.vision_heads,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "max_image_size": shape.max_image_size,
        "out_hidden_size": shape.hidden_size,
        "initializer_range": shape.initializer_range,
        "img_max_token_num": limits["img_max_token_num"],
        "max_vit_seq_len": limits["max_vit_seq_len"],
    }
    return HunYuanVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE],
        im_start_id=ids[IMAGE_START],
        im_end_id=ids[IMAGE_END],
        tie_word_embeddings=True,
        initializer_range=shape.initializer_range,
    )


def build_checkpoint(
    path: str | Path,
    shape: Shape = TINY,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
) -> Path:
    """Write config, random weights, tokenizer, processor and generation config to `path`."""
    import torch
    from transformers import (
        GenerationConfig,
        HunYuanVLForConditionalGeneration,
        HunYuanVLImageProcessor,
        HunYuanVLProcessor,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = build_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = HunYuanVLForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype))
    ids = shape.special_ids
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], do_sample=False
    )
    model.save_pretrained(path)
    del model
    if shape.version == "1.0":
        flatten_config(path / "config.json")
    mark_random(path / "config.json")

    # `size`, not min_pixels/max_pixels: transformers 5.17 writes those two into the class-wide
    # default dict, changing every HunYuanVLImageProcessor built afterwards in the process.
    image_processor = HunYuanVLImageProcessor(
        size={"shortest_edge": shape.min_pixels, "longest_edge": shape.max_pixels}
    )
    processor = HunYuanVLProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(shape),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def mark_random(config_json: Path) -> None:
    """Say in the config that these weights are random: only such a checkpoint may end rows at
    a bench's scripted lengths (ocrq/testing/scripted.py)."""
    from ocrq.models.hunyuan.checkpoint import RANDOM_MARK

    config = json.loads(config_json.read_text())
    config[RANDOM_MARK] = True
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True))


def flatten_config(config_json: Path) -> None:
    """Rewrite a nested config.json in the released 1.0's flat layout: the text fields at the
    top level under their legacy names (`org_vocab_size`, `attention_head_dim`, `rope_scaling`
    of type "xdrope" and `rope_theta`); the vision config stays a nested block."""
    config = json.loads(config_json.read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type", None)
    text["org_vocab_size"] = text.pop("vocab_size")
    text["attention_head_dim"] = text.pop("head_dim")
    text["rope_theta"] = rope["rope_theta"]
    text["rope_scaling"] = {
        "alpha": rope["alpha"],
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": rope.get("factor", 1.0),
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "type": "xdrope",
        "xdrope_section": rope["mrope_section"],
    }
    for key, value in text.items():
        config.setdefault(key, value)
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True))


class ForcedLoop:
    """Tests and benchmarks only: rows of a batch emit a fixed cycle of token ids from a given
    step on, as a model caught in a loop does.

    A forward hook on the model's lm_head adds a large logit to the cycle's next token, counting
    steps with a device tensor, so both decode loops (and the fast loop's CUDA graph, which
    records the hook's operations once and replays them) see the same forced tokens: every loop
    calls lm_head exactly once per generated token. `cycles` holds one list of ids per row of
    the batch; an empty list leaves that row to the model. Use as a context manager around one
    `generate` call of a batch of exactly that many rows.
    """

    BOOST = 1e4

    def __init__(self, model: Any, cycles: list[list[int]], start: int) -> None:
        import torch

        device = model.lm_head.weight.device
        width = max(1, *(len(c) for c in cycles))
        self.model = model
        self.lengths = torch.tensor([max(1, len(c)) for c in cycles], device=device)
        self.pattern = torch.tensor([(c + [0] * width)[:width] for c in cycles], device=device)
        self.forced = torch.tensor([bool(c) for c in cycles], device=device)
        self.start = start
        self.counter = torch.zeros((), dtype=torch.long, device=device)
        self._handle: Any = None

    def _hook(self, _module: Any, _args: Any, out: Any) -> Any:
        import torch

        last = out[:, -1] if out.dim() == 3 else out
        step = self.counter - self.start
        column = (step.clamp(min=0) % self.lengths)[:, None]
        token = self.pattern.gather(1, column)
        active = (self.forced & (step >= 0)).to(last.dtype)[:, None]
        bonus = torch.zeros_like(last).scatter(1, token, self.BOOST) * active
        self.counter += 1
        if out.dim() == 3:
            out = out.clone()
            out[:, -1] += bonus
            return out
        return last + bonus

    def __enter__(self) -> ForcedLoop:
        self.counter.zero_()
        self._handle = self.model.lm_head.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
