"""The memory anatomy `ocrq tune --images` prints: the guide's terms, each measured or marked
as not applying to this engine.

Why these terms: they are how a user reasons about "how big can my batch be" (the guide this
project grew from): weights and the framework's fixed part do not grow with the batch;
activations, the KV cache and the input/output buffers do; the running loop also reserves one
prefill pass. Each number comes from a reading of the engine's memory counter (host RSS for
the CPU engine, the CUDA allocator for a GPU engine: `memory_of(engine)`), taken before and
after a step, except the KV cache, whose bytes per token are the model's shape arithmetic
(`CostModel.per_cache_token_bytes`), and the prefill reserve, which is the running loop's plan.
Pure apart from `reading`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ocrq.models.memory import MemoryProbing
from ocrq.tuning.calibration import Sample

MiB = 1024**2
NO_BATCHES = ("not measured: no static batch nor loop prefill pass ran within the time; the "
              "prefill reserve below plans for the activations")


@dataclass(frozen=True)
class Term:
    name: str
    grows: str  # "no", "per image", "per token"
    bytes: float | None  # None: does not apply to this engine
    how: str  # how it was measured, or why it does not apply

    def row(self) -> tuple[str, str, str, str]:
        if self.bytes is None:
            size = "n/a"
        elif self.bytes < MiB:
            size = f"{self.bytes / 1024:,.1f} KiB"
        else:
            size = f"{self.bytes / MiB:,.1f} MiB"
        return self.name, self.grows, size, self.how


def reading(memory: MemoryProbing) -> int:
    """Memory in use now: a peak window opened and read at once."""
    memory.reset_peak_memory()
    return memory.peak_memory_bytes()


def batch_line(samples: Sequence[Sample], baseline: int) -> tuple[float | None, float | None]:
    """(bytes per batch, bytes per image) of the peaks above the baseline, by least squares on
    the batch size, both kept >= 0 (the CPU engine's peak is one detection's, whatever the
    batch: its per-image part may be ~0); None without static batches (a loop's peaks hold its
    pool)."""
    if not samples:
        return None, None
    n = np.array([len(s.costs) for s in samples], dtype=float)
    y = np.array([s.peak_bytes - baseline for s in samples], dtype=float)
    if len(set(n)) < 2:
        return max(0.0, float(y.mean())), 0.0
    slope, intercept = np.polyfit(n, y, 1)
    if slope < 0:
        return max(0.0, float(y.mean())), 0.0
    if intercept < 0:
        return 0.0, max(0.0, float((y / n).mean()))
    return float(intercept), float(slope)


def anatomy(
    *,
    before_load: int,
    after_load: int,
    baseline: int,
    samples: Sequence[Sample],
    input_bytes_per_image: float,
    kv_bytes_per_token: float,
    tokens_per_image: float | None,
    prefill_reserve: int | None,
    where: str,
    batches_how: str | None = None,
    batches_above: int | None = None,
) -> list[Term]:
    """The anatomy table's terms (see the module docstring). `samples` are static batches'
    peaks above `baseline`, or, with `batches_how` saying how they were taken, the running
    loop's prefill passes' above `batches_above`, the open loop's memory
    (`LoopSetting.prefill_peaks`)."""
    per_batch, per_image = batch_line(samples, baseline if batches_above is None
                                      else batches_above)
    how = f": {batches_how}" if batches_how else ""
    terms = [
        Term("weights", "no", float(max(0, after_load - before_load)),
             f"{where} before vs after loading the engine"
             + ("" if where.startswith("device") else " (with the libraries the load imports)")),
        Term("framework / fixed", "no", float(max(0, baseline - after_load)),
             f"{where} after a first batch (freed) vs after loading: workspaces and caches "
             "that stay"),
        Term("per-batch workspace", "no", per_batch,
             (f"intercept of the peaks{how}" if batches_how else
              "intercept of each batch's peak above that, against the batch size")
             if per_batch is not None else NO_BATCHES),
        Term("activations (prefill)", "per image", per_image,
             (f"slope of the peaks against the rows{how}; the prefill pass reserve below is "
              "the plan for a full pass" if batches_how else
              "slope of each batch's peak against the batch size")
             if per_image is not None else NO_BATCHES),
    ]
    if tokens_per_image is None or kv_bytes_per_token <= 0:
        terms.append(Term("KV cache", "per token", None,
                          "n/a: this engine generates no tokens and keeps no KV cache"))
    else:
        terms.append(Term(
            "KV cache", "per token", kv_bytes_per_token * tokens_per_image,
            f"{kv_bytes_per_token / 1024:.1f} KiB per token (the model's shape) x "
            f"{tokens_per_image:.0f} tokens, the sample's mean prompt + output",
        ))
    terms.append(Term("input / output buffers", "per image", input_bytes_per_image,
                      "host RSS growth per decoded sample image (prefetch holds two batches' "
                      "worth); the text out is negligible"))
    if prefill_reserve is None:
        terms.append(Term("prefill pass reserve", "no", None,
                          "n/a: only the running loop reserves a prefill pass"))
    else:
        terms.append(Term("prefill pass reserve", "no", float(prefill_reserve),
                          "the running loop's plan for one prefill pass (ocrq/models/slots.py)"))
    return terms


def anatomy_table(terms: Sequence[Term], title: str) -> object:
    """A rich Table of the terms."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("term", "grows with", "size", "how"):
        t.add_column(col, justify="right" if col == "size" else "left")
    for term in terms:
        t.add_row(*term.row())
    return t


def to_json(terms: Sequence[Term]) -> list[dict[str, object]]:
    return [{"term": t.name, "grows": t.grows, "bytes": t.bytes, "how": t.how} for t in terms]
