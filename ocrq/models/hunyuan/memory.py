"""HunyuanOCR's memory: the measured default cost model, and the device's counters for tune.

`default_cost_model` is what a worker plans with until `ocrq tune` has measured its own device;
`HunyuanMemory` is the engine's side of ocrq/models/memory.py's MemoryProbing (the CUDA allocator's
counters on a GPU, the host's on a CPU).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ocrq.models.base import PreparedImage
from ocrq.models.costs import CostModel, GiB, ItemCost
from ocrq.models.memory import HostMemory, ProbePage, is_oom_error

KiB = 1024

# Default memory model, measured on an H200 with the 1.0 shape in bf16 and sdpa
# (bench/results/hunyuan_engine_bench/hunyuan_engine_h200.md, transformers 5.17): 1.88 GiB of
# weights allocated and 2.52 GiB of device memory in use once loaded (CUDA context, allocator). The
# peak of a batch is reached in its prefill and is linear in the batch's prompt tokens: 159.9-160.1
# KiB per prompt token (image tokens included; the vision tower's activations scale with them) for
# 1024² pages, 886x1699 receipts and A4 pages at batch 16 to 256 alike, up to 161.2 KiB at batch 1
# (a per-call workspace; bench/results/hunyuan_engine_bench/hunyuan_engine_h200.json,
# bench/results/decode_speed/decode_speed_h200.json): 162 KiB covers every one of them from above,
# by at most 1.3%.
# Decoding then holds the KV cache of prompt + new tokens: 96 KiB per token for this shape, plus
# one layer's prefill cache while it is copied (ocrq/models/hunyuan/prefill.py), hence x 25/24; that
# outgrows the prefill only for long generations (past ~640 new tokens on a 1024² page).
DEFAULT_WEIGHTS_BYTES = int(1.88 * GiB)
DEFAULT_FRAMEWORK_BYTES = int(0.64 * GiB)
DEFAULT_PER_TOKEN_BYTES = 162 * KiB
# The fused text prefill (ocrq/models/hunyuan/prefill.py) keeps fewer float32 intermediates:
# 137.8-137.9 KiB per prompt token at batch 64 and 128 of every page size on the same H200.
DEFAULT_PER_TOKEN_BYTES_FUSED = 139 * KiB
DEFAULT_CACHE_TOKEN_BYTES = 96 * KiB * 25 / 24
# The graphed decode phase's per-batch constant on a GPU, measured at batch 1 where the cache
# term is the peak: a 0.166 GiB peak increment after a 0.142 GiB prefill, against 0.126 GiB of
# cache (bench/results/decode_speed/decode_speed_h200.json).
DEFAULT_DECODE_FIXED_BYTES = 42 * 1024 * KiB

# Share of the device memory still free after loading that batches may use by default; the rest
# covers the allocator's fragmentation (reserved minus allocated) and cuBLAS/cuDNN workspaces.
DEFAULT_FREE_SHARE = 0.85
# New tokens `probe` forces at most (see there): enough decode steps to reach the cache's
# growth, few enough that `ocrq tune` stays within seconds per probe.
PROBE_NEW_TOKENS = 64


@dataclass(frozen=True)
class VersionDefaults:
    """A model version's measured default coefficients (per prompt token, per decode path)."""

    fixed_bytes: int
    per_token_bytes: int  # transformers' own prefill
    per_token_bytes_fused: int  # the fused fast prefill


# 1.0 and 1.5 share one backbone (same layers, widths and vocabulary;
# ocrq/models/hunyuan/versions.py),
# so their weights, and their bytes per token at equal image sizes, are the same: 1.5's entry is
# 1.0's measurement until bench/hunyuan15_presets.py has measured 1.5's shape on the H200. What
# 1.5 changes is how many tokens an image may bring (16,514 at its 4096² limit where 1.0 stops at
# 4,162), which the estimate counts.
VERSION_DEFAULTS: dict[str, VersionDefaults] = {
    "1.0": VersionDefaults(
        DEFAULT_WEIGHTS_BYTES + DEFAULT_FRAMEWORK_BYTES,
        DEFAULT_PER_TOKEN_BYTES,
        DEFAULT_PER_TOKEN_BYTES_FUSED,
    ),
}
VERSION_DEFAULTS["1.5"] = VERSION_DEFAULTS["1.0"]


def default_cost_model(
    decode_path: str,
    cache_token_bytes: float = DEFAULT_CACHE_TOKEN_BYTES,
    decode_fixed_bytes: float = DEFAULT_DECODE_FIXED_BYTES,
    version: str = "1.5",
) -> CostModel:
    """The measured default memory model for a version and decode path (see the constants
    above)."""
    fused = decode_path == "fast-fused"
    defaults = VERSION_DEFAULTS[version]
    return CostModel(
        fixed_bytes=defaults.fixed_bytes,
        per_token_bytes=float(
            defaults.per_token_bytes_fused if fused else defaults.per_token_bytes
        ),
        per_cache_token_bytes=float(cache_token_bytes),
        decode_fixed_bytes=float(decode_fixed_bytes),
        source="default",
    )


def cache_token_bytes(model: Any) -> float:
    """K and V of every layer for one token, in the model's dtype, plus one layer's share (the
    prefill cache of the layer being copied into the static cache coexists with it); the 1.0
    shape's before a model is loaded."""
    if model is None:
        return float(DEFAULT_CACHE_TOKEN_BYTES)
    cfg = model.config.text_config
    layers = int(cfg.num_hidden_layers)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_layer = 2 * int(cfg.num_key_value_heads) * head_dim * model.dtype.itemsize
    return float(per_layer * (layers + 1))


class HunyuanMemory:
    """MemoryProbing for HunyuanEngine (a mixin: it reads the engine's `device` and `settings`
    and calls its `generate` and `estimate`). On a GPU, the CUDA allocator's counters; on a
    CPU, the host's (ocrq/models/memory.py)."""

    # "decode" is the loop (fast, fused, or transformers' generate): their activations differ.
    # "version" (1.0 or 1.5, from the checkpoint) keeps the two models' profiles apart even
    # where one folder or revision held either.
    profile_fields: tuple[str, ...] = (
        "model",
        "revision",
        "version",
        "dtype",
        "attention",
        "max_new_tokens",
        "decode",
    )
    device: str | None
    settings: Any

    def _cuda(self) -> bool:
        return self.device is not None and self.device.startswith("cuda")

    def _host(self) -> HostMemory:
        return HostMemory(self)  # type: ignore[arg-type]

    def is_oom(self, exc: BaseException) -> bool:
        return is_oom_error(exc)

    def release_memory(self) -> None:
        """After an OOM: drop the failed batch's garbage and return cached blocks to the device."""
        gc.collect()
        if self._cuda():
            import torch

            torch.cuda.empty_cache()

    def default_budget_bytes(self) -> int:
        """On a GPU, a share of the memory left free after loading; elsewhere the host's."""
        if not self._cuda():
            return self._host().default_budget_bytes()
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(self.device))
        return int(free * DEFAULT_FREE_SHARE)

    def fragmentation_bytes(self) -> int | None:
        if not self._cuda():
            return None
        import torch

        torch.cuda.empty_cache()
        dev = torch.device(self.device)
        return int(torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))

    def probe_pages(self) -> Sequence[ProbePage]:
        """A word crop (upscaled to 512² by the processor), a 1024² page, a 886x1699 receipt and
        an A4 scan at 150 dpi, the sizes of
        bench/results/hunyuan_engine_bench/hunyuan_engine_h200.md."""
        return (
            ProbePage("crop-240x64", 240, 64, ("STATION",), 24),
            ProbePage("page-1024", 1024, 1024),
            ProbePage("receipt-886x1699", 886, 1699, font_size=32),
            ProbePage("a4-1248x1760", 1248, 1760),
        )

    def reset_peak_memory(self) -> None:
        if not self._cuda():
            return self._host().reset_peak_memory()
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int:
        """Peak bytes allocated by tensors on the device (weights included): what the cost
        model predicts. The allocator reserves a few percent more; budgets leave room for it."""
        if not self._cuda():
            return self._host().peak_memory_bytes()
        import torch

        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_capacity_bytes(self) -> int:
        if not self._cuda():
            return self._host().memory_capacity_bytes()
        import torch

        return int(torch.cuda.mem_get_info(torch.device(self.device))[1])

    def probe(self, batch: Sequence[PreparedImage]) -> list[ItemCost]:
        """Generate exactly min(max_new_tokens, PROBE_NEW_TOKENS) tokens per image.

        Forcing the length measures the worst case (a real model may stop early). The cap keeps
        a probe within seconds: the peak comes from the prefill, which is what the fit measures;
        the longer generation's KV cache is the cost model's decode part, computed from the
        model's shape (`cache_token_bytes`).
        """
        n = min(self.settings.max_new_tokens, PROBE_NEW_TOKENS)
        self.generate(batch, max_new_tokens=n, min_new_tokens=n)  # type: ignore[attr-defined]
        unused = self.settings.max_new_tokens - n
        costs = map(self.estimate, batch)  # type: ignore[attr-defined]
        return [replace(c, tokens=c.tokens - unused, new_tokens=n) for c in costs]
