"""HunyuanOCR 1.0 and 1.5: what differs between them, and which one a checkpoint holds.

Why one engine for both: the backbone is the same (text 1024 x 24 layers, vision 1152 x 27,
patch 16, merge 2); what changed in 1.5 is its prompts (twelve where 1.0 had six), its image
limit (about 4096² pixels where 1.0 stops at 2048²; the processor carries it), its context
(131072 positions) and its decoding (Tencent's clients all decode 1.5 greedily with a repetition
penalty of 1.08). So the engine loads either through the same code and asks this module what the
loaded one needs.

The version is read from the checkpoint's config.json, never from a flag (a flag can disagree
with the weights): 1.0 ships a flat config (text fields at the top level), 1.5 a nested one
(`text_config`, `vision_config`). A 1.0 checkpoint re-saved by transformers >= 5.13 is nested
too, so the limits decide wherever the config states them: 1.5 raised `max_position_embeddings`
32768 -> 131072, `img_max_token_num` 4096 -> 16384 and `max_vit_seq_len` 16384 -> 65536.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ocrq.models.hunyuan.prompts import VERSION_PROMPTS

# 1.0's limits; anything above one of them is 1.5's.
V1_0_LIMITS = {
    "max_position_embeddings": 32768,
    "img_max_token_num": 4096,
    "max_vit_seq_len": 16384,
}
V1_5_LIMITS = {
    "max_position_embeddings": 131072,
    "img_max_token_num": 16384,
    "max_vit_seq_len": 65536,
}


@dataclass(frozen=True)
class RepetitionGuard:
    """When a row's tail repeats, stop it early (ocrq/models/hunyuan/repetition.py).

    Tencent's 1.5 clients stop a row whose last 8000 characters end in >= 8 back-to-back copies
    of a unit of 1..256 characters, checked on the decoded text from 4000 characters on, every
    1000 (the transformers client every 64 tokens). ocrq checks the generated token ids instead,
    on the device, every `every` steps: a loop in the text is a loop in the ids the model emits,
    and ids need no decoding. A unit of u tokens counts as a loop when it repeats at least
    `min_repeats` times AND the repeats cover at least `min_span` tokens; the span stands in for
    Tencent's 4000-character gate, so that short legitimate runs (a table row of zeros, dot
    leaders) are not cut, while a real loop, which never ends by itself, is stopped within
    `min_span + every` tokens of its start.
    """

    every: int = 32  # steps between checks (a multiple of the loop's own host check)
    min_repeats: int = 8
    max_unit: int = 128  # tokens (256 characters are at most ~256 tokens, usually far fewer)
    min_span: int = 256  # tokens the repeated tail must cover

    def span(self, unit: int) -> int:
        """Tokens a loop of `unit` tokens must cover to be stopped."""
        copies = max(self.min_repeats, -(-self.min_span // unit))
        return copies * unit

    @property
    def window(self) -> int:
        """Tail tokens a check reads: the longest span of any unit."""
        return max(self.span(u) for u in range(1, self.max_unit + 1))


@dataclass(frozen=True)
class ModelVersion:
    name: str  # "1.0" | "1.5"
    prompts: Mapping[str, str]
    max_pixels: int  # the released processor's limit (the loaded processor's own is used)
    repetition_penalty: float  # Tencent's decoding; 1.0 = none
    guard: RepetitionGuard = field(default_factory=RepetitionGuard)


V1_0 = ModelVersion("1.0", VERSION_PROMPTS["1.0"], 2048 * 2048, 1.0)
# 1.5: repetition_penalty 1.08 in every Tencent client (vLLM, batch, transformers), "built in,
# do not change" (docs/inference); max_pixels ~4096x4096 (docs; processor longest_edge 4096²).
V1_5 = ModelVersion("1.5", VERSION_PROMPTS["1.5"], 4096 * 4096, 1.08)
VERSIONS: dict[str, ModelVersion] = {v.name: v for v in (V1_0, V1_5)}
# What an engine assumes before it has loaded a checkpoint: the repository root's model.
LATEST = V1_5


def version_of_config(config: Mapping[str, Any]) -> ModelVersion:
    """The version a raw config.json (as a dict) describes; see the module docstring."""
    text = config.get("text_config") or config
    vision = config.get("vision_config") or config
    stated = False
    for name, limit in V1_0_LIMITS.items():
        value = (text if name == "max_position_embeddings" else vision).get(name)
        if isinstance(value, int | float):
            stated = True
            if value > limit:
                return V1_5
    if stated:
        return V1_0
    return V1_5 if isinstance(config.get("text_config"), Mapping) else V1_0


def version_of_checkpoint(path: Path) -> ModelVersion:
    """The version of the checkpoint directory `path` (its config.json)."""
    return version_of_config(json.loads((Path(path) / "config.json").read_text()))
