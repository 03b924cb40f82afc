"""Fit a CostModel's coefficients to measured probe batches: a pure function, no device.

Why least squares on the model's own features: the prefill part of `CostModel.peak_bytes` is
linear in (1, n, n * max(prompt tokens), sum(patches)), so probes of a few batch sizes and image
sizes pin the coefficients down, and checking the fit is the same arithmetic the planner does.
Probes generate few tokens, so they measure the prefill; the decode part's bytes per cached
token are the engine's KV-cache arithmetic (`Engine.cache_token_bytes`), passed in, not fitted.
Two guards make the result safe to plan with:

* coefficients are kept non-negative (a negative byte count per image would let a big enough
  batch predict less than a small one); a feature that would need a negative weight is dropped
  and the rest refitted, the usual active-set treatment for so few features;
* with `cover=True` the model is moved up just enough that it predicts at least every measured
  peak (see `fit` for how): the planner must err towards a smaller batch, never an OOM.

A feature absent from every probe (the CPU engine has no tokens) gets a zero coefficient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ocrq.models.costs import CostModel, ItemCost

FEATURES = ("fixed_bytes", "per_item_bytes", "per_token_bytes", "per_patch_bytes")


@dataclass(frozen=True)
class Sample:
    """One measured batch: the items' costs as run and the peak bytes measured around it.

    An empty `costs` is a baseline reading (the engine loaded, nothing running): it anchors the
    fixed part.
    """

    costs: tuple[ItemCost, ...]
    peak_bytes: int


@dataclass(frozen=True)
class Fit:
    """The fitted model and how well it explains the samples it came from."""

    model: CostModel
    cover_factor: float  # how much the per-image part was scaled to cover every sample (>= 1)
    max_rel_error: float  # max |predicted - measured| / measured over the samples, after cover
    samples: int


def features(costs: Sequence[ItemCost]) -> list[float]:
    """The design row of one batch, in FEATURES order (what CostModel.peak_bytes multiplies)."""
    if not costs:
        return [1.0, 0.0, 0.0, 0.0]
    n = len(costs)
    return [
        1.0,
        float(n),
        float(n * max(c.prompt_tokens for c in costs)),
        float(sum(c.patches for c in costs)),
    ]


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0, dropping negative ones and refitting."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0.0)]
    coef = np.zeros(x.shape[1])
    while active:
        sub = x[:, active]
        scale = np.abs(sub).max(axis=0)  # columns span 1 to ~1e7: scale for a stable solve
        solved, *_ = np.linalg.lstsq(sub / scale * w[:, None], y * w, rcond=None)
        solved = solved / scale
        if np.all(solved >= 0.0):
            coef[:] = 0.0
            coef[active] = solved
            return coef
        active.pop(int(np.argmin(solved)))
    return coef


def _model(
    coef: np.ndarray, source: str, cache_token_bytes: float, decode_fixed_bytes: float
) -> CostModel:
    return CostModel(
        fixed_bytes=round(float(coef[0])),
        per_item_bytes=float(coef[1]),
        per_token_bytes=float(coef[2]),
        per_patch_bytes=float(coef[3]),
        per_cache_token_bytes=float(cache_token_bytes),
        decode_fixed_bytes=float(decode_fixed_bytes),
        source=source,
    )


def fit(
    samples: Sequence[Sample],
    *,
    min_fixed_bytes: int = 0,
    cover: bool = True,
    source: str = "fit",
    cache_token_bytes: float = 0.0,
    decode_fixed_bytes: float = 0.0,
) -> Fit:
    """The CostModel that best explains `samples` (see the module docstring for the guards).

    Errors are weighted by 1/measured, so a batch of one counts as much as a batch near the
    budget: the planner needs a small relative error everywhere. The fixed part is fitted like
    the other coefficients (it then also holds what every batch allocates once, whatever its
    size), but never below `min_fixed_bytes`, the memory measured resident before any batch:
    when the free fit would go lower, it is pinned there and the rest refitted above it.

    `cache_token_bytes` and `decode_fixed_bytes` become the model's decode part as given (see
    the module docstring); samples that part explains better are left out of the prefill fit.

    Covering every sample combines two moves, see `_cover`: scaling the per-image part (right
    when big batches are under-predicted) and raising the fixed part (right when a constant,
    a per-call workspace say, is missing at small batches).
    """
    if not samples:
        raise ValueError("fit needs at least one sample")
    x = np.array([features(s.costs) for s in samples], dtype=np.float64)
    y = np.array([float(s.peak_bytes) for s in samples], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1.0)
    decoding = CostModel(0, per_cache_token_bytes=cache_token_bytes,
                         decode_fixed_bytes=decode_fixed_bytes)
    decode = np.array([decoding.decode_bytes(s.costs) for s in samples])
    # Samples whose peak is the decode's (small batches of short prompts) say nothing about the
    # prefill coefficients: fit those on the others, found by fitting twice.
    keep = np.ones(len(samples), dtype=bool)
    coef = _solve(x, y, w, min_fixed_bytes)
    if np.any(decode > 0):
        bound = decode > x @ coef - coef[0]
        if np.count_nonzero(~bound) >= 2 and np.any(bound):
            keep = ~bound
            coef = _solve(x[keep], y[keep], w[keep], min_fixed_bytes)
    factor = 1.0
    if cover:
        coef, factor = _cover(x[keep], y[keep], coef)
    model = _model(coef, source, cache_token_bytes, decode_fixed_bytes)
    if cover:  # the planner's integer arithmetic rounds: cover to the byte
        short = max(s.peak_bytes - model.peak_bytes(list(s.costs)) for s in samples)
        if short > 0:
            model = replace(model, fixed_bytes=model.fixed_bytes + short)
    errors = [relative_error(model, s) for s in samples]
    return Fit(model, float(factor), float(max(abs(e) for e in errors)), len(samples))


def _solve(x: np.ndarray, y: np.ndarray, w: np.ndarray, min_fixed_bytes: int) -> np.ndarray:
    coef = _nonnegative_lstsq(x, y, w)
    if coef[0] < min_fixed_bytes:
        coef[0] = float(min_fixed_bytes)
        coef[1:] = _nonnegative_lstsq(x[:, 1:], y - coef[0], w)
    return coef


def _cover(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> tuple[np.ndarray, float]:
    """The smallest move up (scale s >= 1 of the per-image part, then the fixed part raised by
    what is still missing) after which no sample is under-predicted, chosen to minimise the
    largest relative error. Candidate scales: 1, each sample's own exact-cover scale, and a
    grid between; a handful of samples makes this exhaustive search cheap."""
    batch_part = x[:, 1:] @ coef[1:]
    if not np.any(y - coef[0] - batch_part > 1.0):  # a byte: float rounding, not a miss
        return coef, 1.0
    has_part = batch_part > 0.0
    exact = (y[has_part] - coef[0]) / batch_part[has_part]
    top = max(1.0, float(exact.max(initial=1.0)))
    scales = np.unique(np.concatenate([[1.0], exact[exact > 1.0], np.linspace(1.0, top, 64)]))
    best: tuple[float, np.ndarray, float] | None = None
    for scale in scales:
        raise_by = max(0.0, float(np.max(y - coef[0] - scale * batch_part)))
        predicted = coef[0] + raise_by + scale * batch_part
        worst = float(np.max(np.abs(predicted - y) / y))
        if best is None or worst < best[0]:
            moved = coef.copy()
            moved[0] += raise_by
            moved[1:] *= scale
            best = (worst, moved, float(scale))
    assert best is not None
    return best[1], best[2]


def relative_error(model: CostModel, sample: Sample) -> float:
    """(predicted - measured) / measured peak; positive means the model over-predicts."""
    predicted = model.peak_bytes(list(sample.costs)) if sample.costs else model.fixed_bytes
    return (predicted - sample.peak_bytes) / sample.peak_bytes
