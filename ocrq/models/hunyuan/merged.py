"""Projections that read the same input, merged into one weight for the fused decode step.

Why: a decode step of a few rows is launch-bound (bench/results/lanes/README.md: ~370 kernels
a step, an interactive-only step 2.45 ms against a 0.42 ms weight-read floor), and at a few
hundred rows the narrow GEMMs leave SMs idle. q, k and v read the same normalised row, as do
the MLP's gate and up: one GEMM each instead of three and two. The modules' own weights become
row-slices (views) of the merged weight, so memory stays the same and every other path
(prefill, `generate()`) reads the same numbers through its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def merge_linears(*linears: Any) -> torch.Tensor | None:
    """One (sum of outputs, inputs) weight for bias-free linears over the same input, the
    linears' weights re-pointed at its row slices; None where they cannot share one (a bias,
    different dtypes, devices or input widths). Idempotent: linears already sharing one merged
    weight get it back."""
    import torch

    weights = [lin.weight for lin in linears]
    if any(getattr(lin, "bias", None) is not None for lin in linears):
        return None
    first = weights[0]
    if any(w.dim() != 2 or w.dtype != first.dtype or w.device != first.device
           or w.shape[1] != first.shape[1] for w in weights):
        return None
    merged = getattr(linears[0], "_ocrq_merged", None)
    if merged is not None and _slices_of(merged, weights):
        return merged  # merged before: a second decoder over the same model
    with torch.no_grad():
        merged = torch.cat([w.detach() for w in weights], 0)
        at = 0
        for lin, w in zip(linears, weights, strict=True):
            n = w.shape[0]
            lin.weight.data = merged[at:at + n]
            at += n
    linears[0]._ocrq_merged = merged
    return merged


def _slices_of(merged: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `weights` are still `merged`'s consecutive row slices, in order."""
    at = merged.data_ptr()
    for w in weights:
        if w.data_ptr() != at:
            return False
        at += w.numel() * w.element_size()
    return at == merged.data_ptr() + merged.numel() * merged.element_size()
