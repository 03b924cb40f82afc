"""Memory cost of a batch: a fixed part plus per-image terms, padding to the longest sequence.

The model is linear on purpose: its coefficients are measured by probing the device (`ocrq tune`)
and a linear fit over a handful of probes is both stable and easy to check against measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class ItemCost:
    """What one image brings to a batch.

    tokens: sequence length the text model holds for it (prompt + image tokens + max new
        tokens); batches pad every sequence to the longest, so the planner groups similar ones.
    new_tokens: the generated part of `tokens` (0 for engines that generate nothing).
    patches: vision-encoder patches (or, for the CPU engine, KiB of per-image working memory).
    pixels: pixels after the engine's own resize, for logs and downscaling decisions.
    """

    tokens: int
    patches: int
    pixels: int
    new_tokens: int = 0  # of `tokens`, those generated: held only once the prompt is processed

    @property
    def prompt_tokens(self) -> int:
        return self.tokens - self.new_tokens


@dataclass(frozen=True)
class CostModel:
    """Predicted peak bytes = fixed + max(prefill, decode), where

    prefill = per_item*n + per_token*n*max(prompt tokens) + per_patch*sum(patches)
    decode  = per_cache_token*n*max(tokens) + decode_fixed

    Why two phases: a generating engine's peak is its prefill's activations (vision tower, text
    prefill) until the KV cache of prompt + new tokens outgrows them. Charging the new tokens at
    the prefill's rate over-predicted by up to 15% at 256 new tokens on an H200
    (bench/results/decode_speed/decode_speed_h200_step1.md), and more the longer the generation;
    charging them nothing would under-predict a long one. `fixed_bytes` is weights + framework +
    workspace: what is resident before any image arrives. `decode_fixed_bytes` is what the
    decode phase holds whatever the batch (workspaces of the graphed step): it only shows when
    the cache term wins, at batch 1 say. Engines that generate nothing leave both decode
    coefficients at 0.
    """

    fixed_bytes: int
    per_item_bytes: float = 0.0
    per_token_bytes: float = 0.0
    per_patch_bytes: float = 0.0
    per_cache_token_bytes: float = 0.0
    decode_fixed_bytes: float = 0.0
    source: str = "default"  # "default" or the profile the coefficients were fitted from

    def batch_bytes(self, costs: Sequence[ItemCost]) -> int:
        """Bytes the batch adds on top of `fixed_bytes`."""
        return int(max(self.prefill_bytes(costs), self.decode_bytes(costs)))

    def prefill_bytes(self, costs: Sequence[ItemCost]) -> float:
        if not costs:
            return 0.0
        n = len(costs)
        return (
            self.per_item_bytes * n
            + self.per_token_bytes * n * max(c.prompt_tokens for c in costs)
            + self.per_patch_bytes * sum(c.patches for c in costs)
        )

    def decode_bytes(self, costs: Sequence[ItemCost]) -> float:
        if not costs or not self.per_cache_token_bytes:
            return 0.0
        longest = max(c.tokens for c in costs)
        return self.per_cache_token_bytes * len(costs) * longest + self.decode_fixed_bytes

    def peak_bytes(self, costs: Sequence[ItemCost]) -> int:
        return self.fixed_bytes + self.batch_bytes(costs)
