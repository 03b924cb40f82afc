"""Which step makes a running-loop decode step's logits: today's, or the fused few-row step.

Why a module of its own: the fused step (ocrq/models/hunyuan/fused_step.py: five kernels a layer,
each weight streamed once) is a lab lever, `OCRQ_LOOP_FUSED_STEP_ROWS` (`LoopConfig.
fused_step_rows`), off by default: in the loop on an H100 its 8-slot steps took 3.4 ms where
today's take 1.4 (bench/results/fused_step/README.md; the cause is not yet found). Whether the
loop can take it, and the one `FusedStep` per bucket it takes, are decided here, so the runner
(ocrq/models/hunyuan/runner.py) only asks `serves(k)` and calls it. Everything after the logits
(the greedy choice, the hooks, the books) is the runner's, unchanged.

What fits: the fused step reads the pool as the loop keeps it (one pool per layer, keys
token-major, values token-major or transposed, row r's keys [start_r, end_r), the new one
written at col_r = end_r - 1, PAD_KEYS readable keys past the scratch column;
ocrq/models/hunyuan/slot_tensors.py) and writes an fp8 pool as `kv_cache.to_cache` does
(saturated, no scale). So it serves the loop where:

* the loop's attention is Triton's (the fused step is Triton kernels; the torch path keeps its
  per-slot mask and today's step);
* an fp8 pool's products are widened (`OCRQ_KV_FP8_PRODUCTS` off): the fused attention has no
  e4m3 products, and a row's arithmetic would then change with its bucket;
* every layer's q/k/v and gate/up weights are merged (ocrq/models/hunyuan/merged.py: no bias,
  SiLU): the fused step reads the merged weights, and one that could not merge would be a copy
  outside the memory plan (or a bias the kernels do not add);
* the head dim is a power of two >= 16 (its tiles).

Elsewhere the lever is left off, with a warning at the loop's start saying why; where it is on,
one info line says for which buckets.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.kv_cache import is_fp8

if TYPE_CHECKING:
    import torch

    from ocrq.models.hunyuan.fused_step import FusedStep, FusedWeights
    from ocrq.models.hunyuan.loop_types import LoopConfig
    from ocrq.models.hunyuan.text import TextModel

log = logging.getLogger(__name__)

LEVER = "OCRQ_LOOP_FUSED_STEP_ROWS"


class FusedSteps:
    """The fused step for the loop's buckets of at most `rows` slots, one `FusedStep` a bucket,
    built at its first step (outside any CUDA graph capture: the runner runs a bucket's first
    step eagerly) and kept, as the runner keeps its attention kernels."""

    def __init__(self, text: TextModel, weights: FusedWeights, rows: int, device: Any,
                 padded: bool) -> None:
        self.text, self.weights, self.rows = text, weights, rows
        self.device, self.padded = device, padded
        self.steps: dict[int, FusedStep] = {}

    def serves(self, k: int) -> bool:
        """Whether a step over the first `k` slots takes the fused step."""
        return k <= self.rows

    def __call__(self, k: int, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor,
                 start: torch.Tensor, end: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> torch.Tensor:
        """Logits (k, V) of a step over slots [0, k): the arguments of `TextModel.step(...,
        pooled=True)` plus the visible ranges (`fused_decode_step`)."""
        from ocrq.models.hunyuan.fused_step import FusedStep, fused_decode_step

        step = self.steps.get(k)
        if step is None:
            step = self.steps[k] = FusedStep(self.weights, k, self.device, padded=self.padded)
        return fused_decode_step(self.text, step, tok, pos, col, start, end, keys, values)


def fused_steps(text: TextModel, config: LoopConfig, device: Any, *, use_triton: bool,
                kv_dtype: Any, padded: bool) -> FusedSteps | None:
    """The loop's fused steps where `config.fused_step_rows` asks for them and they fit (the
    module's doc); None otherwise, with a line in the log where the lever was on."""
    rows = config.fused_step_rows
    if not rows:
        return None
    why = _unfit(text, config, use_triton, kv_dtype)
    if why:
        log.warning("%s=%d ignored: %s; the running loop keeps today's decode step",
                    LEVER, rows, why)
        return None
    from ocrq.models.hunyuan.fused_step import FusedWeights

    log.info("running loop: the fused decode step for buckets of <= %d slots (%s; lab lever, "
             "measured slower than today's step in the loop on an H100)", rows, LEVER)
    return FusedSteps(text, FusedWeights.from_text(text), rows, device, padded)


def _unfit(text: TextModel, config: LoopConfig, use_triton: bool, kv_dtype: Any) -> str:
    """Why the fused step cannot serve this loop; empty where it can."""
    if not use_triton:
        return "the loop's decode attention is torch's, the fused step is Triton's"
    if is_fp8(kv_dtype) and config.fp8_products:
        return "the fused step has no e4m3 products (OCRQ_KV_FP8_PRODUCTS)"
    d = text.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    qkv, gate_up = text.merge()
    if any(w is None for w in (*qkv, *gate_up)):
        return ("not every layer's q/k/v and gate/up weights merge (a bias, not SiLU, or "
                "text.MERGED_PROJECTIONS off)")
    return ""
