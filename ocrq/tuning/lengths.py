"""How many tokens each sample image makes, so the sweep decodes as long as the service will.

Why it matters: a generating engine's time and KV cache follow the output length, and the
sweet spot of a batch of word crops (a dozen tokens) is not that of dense pages (a thousand).
Three cases:

* a trained HunyuanOCR: a first pass over the sample, capped at OCRQ_MAX_NEW_TOKENS, counts the
  tokens each image actually produces; the sweep then ends each row there (as the model would).
  It runs FIRST_PASS_ROWS images a call and stops at tune's deadline (--max-seconds), after
  one call at least; the images it did not reach get the median of those it did;
* a random-weight checkpoint (ocrq/testing/tiny_hunyuan.py marks it): it never emits an end of
  sequence, so each row gets a length drawn the way the bench draws them (bench/
  continuous_batching.py: lognormal around a median per page class, the class nearest in
  pixels), as ocrq/testing/scripted.py explains;
* an engine that generates nothing (the CPU engine): no lengths.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ocrq.models.base import Engine, OcrResult, PreparedImage
from ocrq.models.hunyuan.checkpoint import is_random_checkpoint

# The bench's classes: (width, height) and median new tokens (bench/continuous_batching.py).
CLASSES = {"crop": ((240, 64), 12), "receipt": ((886, 1699), 300), "a4": ((1248, 1760), 1100)}
SPREAD = 0.35  # the bench's lognormal sigma
FIRST_PASS_ROWS = 4  # images a first-pass call: a batch, yet a deadline is looked at often


@dataclass(frozen=True)
class Lengths:
    tokens: tuple[int, ...] | None  # per row, in the sample's order; None: not a generating engine
    source: str

    def describe(self) -> str:
        if self.tokens is None:
            return f"output lengths: {self.source}"
        ordered = sorted(self.tokens)
        return (
            f"output lengths ({self.source}): {ordered[0]}..{ordered[-1]} tokens, "
            f"median {ordered[len(ordered) // 2]}"
        )


def drawn_length(size: tuple[int, int], cap: int, rng: random.Random) -> int:
    """A bench length for an image of `size`: its nearest class's median, spread lognormally."""
    pixels = size[0] * size[1]
    cls = min(CLASSES, key=lambda c: abs(math.log(pixels / (CLASSES[c][0][0] * CLASSES[c][0][1]))))
    return max(1, min(cap, int(rng.lognormvariate(0, SPREAD) * CLASSES[cls][1])))


def generated_tokens(engine: Engine, result: OcrResult | Exception, cap: int) -> int:
    """Tokens a first-pass result took: the cap when cut there, else its text re-tokenised plus
    the end of sequence."""
    if isinstance(result, Exception):
        return cap
    if result.truncated == "max_tokens":
        return cap
    tokenizer = getattr(getattr(engine, "processor", None), "tokenizer", None)
    if tokenizer is None:
        return cap
    ids = tokenizer(result.text, add_special_tokens=False)["input_ids"]
    return max(1, min(cap, len(ids) + 1))


def output_lengths(
    engine: Engine, rows: Sequence[PreparedImage], seed: int = 0, deadline: float | None = None
) -> Lengths:
    """Each row's output length (see the module docstring); sets `max_new_tokens` on the rows.
    `deadline` (time.monotonic()) cuts a first pass between its calls."""
    settings = getattr(engine, "settings", None)
    cap = getattr(settings, "max_new_tokens", None)
    if cap is None or not hasattr(engine, "processor"):
        return Lengths(None, "not a generating engine")
    model_dir: Path | None = getattr(engine, "model_dir", None)
    if model_dir is not None and is_random_checkpoint(model_dir):
        rng = random.Random(seed)
        tokens = [drawn_length(row.image.size, cap, rng) for row in rows]
        source = "random weights: the bench's drawn lengths"
    else:
        tokens = []
        for i in range(0, len(rows), FIRST_PASS_ROWS):
            if tokens and deadline is not None and time.monotonic() >= deadline:
                break
            results = engine.run(list(rows[i : i + FIRST_PASS_ROWS]))
            tokens += [generated_tokens(engine, r, cap) for r in results]
        source = f"first pass, capped at {cap}"
        if len(tokens) < len(rows):
            median = sorted(tokens)[len(tokens) // 2]
            source += (f"; cut by --max-seconds after {len(tokens)} of {len(rows)} images, the "
                       f"rest given their median ({median})")
            tokens += [median] * (len(rows) - len(tokens))
    for row, n in zip(rows, tokens, strict=True):
        row.max_new_tokens = n
    return Lengths(tuple(tokens), source)
