"""The special token ids generation stops at and pads with, read once from the checkpoint.

Why one object: both decode loops (transformers' `generate()` and ocrq/models/hunyuan/decode.py) and
the cut of each row at its end of sequence must agree on them. The engine holds the only
`SpecialTokens` and hands it to whichever loop runs a batch, so changing the eos set (tests name
tokens a random model emits) changes it everywhere at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpecialTokens:
    eos: frozenset[int]  # any of these ends a row
    pad: int  # what finished rows and left padding are filled with

    @classmethod
    def read(cls, generation_config: Any, tokenizer: Any) -> SpecialTokens:
        """Every id the checkpoint says ends an answer: its generation config's and its
        tokenizer's eos. Why both: they may disagree (a 1.5 generation config is reported to
        name 120020 where its tokenizer's eos, `<｜hy_Assistant｜>`, is what Tencent's clients
        stop at), and a missed eos runs a row to the token cap. (The text config's eos is left
        out: where a config omits it, transformers fills in a generic default id.)
        """
        ids: set[int] = set()
        for eos in (generation_config.eos_token_id, tokenizer.eos_token_id):
            ids |= {eos} if isinstance(eos, int) else set(eos or [])
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = generation_config.pad_token_id
        return cls(frozenset(int(i) for i in ids), int(pad))

    @property
    def eos_list(self) -> list[int]:
        """Sorted, as generation configs and device tensors take them."""
        return sorted(self.eos)

    def cut(self, rows: Iterable[list[int]]) -> tuple[list[list[int]], list[bool]]:
        """Each generated row up to (not including) its first eos, and whether it had none
        (it stopped at max_new_tokens: its output may be a loop worth trimming)."""
        kept: list[list[int]] = []
        capped: list[bool] = []
        for row in rows:
            end = next((k for k, t in enumerate(row) if t in self.eos), None)
            kept.append(row if end is None else row[:end])
            capped.append(end is None)
        return kept, capped
