"""Decoding against loops: the repetition penalty and the tail-repetition guard, for both loops.

Why both: greedy decoding of a VLM can fall into a loop on unusual layouts and then emits the
same few tokens until the token cap (HunyuanOCR issue #53); that row holds its batch's KV cache
and keeps the whole batch running for nothing. Tencent's 1.5 answer is a repetition penalty of
1.08 (every token id seen so far, prompt included, has its logit divided by 1.08 when positive
and multiplied when negative: transformers' RepetitionPenaltyLogitsProcessor) plus an early stop
of a row whose tail repeats (ocrq/models/hunyuan/versions.py, `RepetitionGuard`).

* `penalise` is the penalty as the fast loop applies it: a gather and a scatter over each row's
  token history, a fixed-shape (B, prompt + new tokens) tensor on the device, so one decode step
  stays capturable in a CUDA graph. The history holds the row's own tokens only: where
  transformers' batched `generate()` also penalises the pad id in left-padded rows, a row here
  is penalised exactly as it is alone (as Tencent runs it: one image per `generate()`).
* `looping_rows` finds the rows whose generated tail is a loop, on the device, for a whole batch
  in one gather (no per-row Python); the fast loop runs it every `guard.every` steps outside the
  graph, `generate()` through `GuardCriteria`, at the same token counts, so both stop the same
  rows at the same length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.versions import RepetitionGuard

if TYPE_CHECKING:
    import torch

# Rows compared per gather: bounds the check's scratch memory (2 x rows x 128 units x 896 int32,
# 15 MB) at any batch size.
GUARD_ROWS = 16


def penalise(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """`scores` (B, V) float32 with every id in `history` (B, H) penalised once, as
    transformers' RepetitionPenaltyLogitsProcessor computes it (duplicates write equal values)."""
    import torch

    picked = scores.gather(1, history)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(1, history, picked)


def history_of(
    ids: torch.Tensor, mask: torch.Tensor, start: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """The token history (B, L + new_tokens) a batch starts decoding with: each row's prompt,
    its left padding and its future slots filled with the row's first real token (a duplicate
    changes nothing), so the penalty sees each row's own tokens only."""
    import torch

    first = ids.gather(1, start.long()[:, None])
    prompt = torch.where(mask.bool(), ids, first)
    return torch.cat([prompt, first.expand(-1, max(new_tokens, 1))], dim=1).contiguous()


class LoopFinder:
    """`looping_rows` for one guard, with its index tensors built once per device."""

    def __init__(self, guard: RepetitionGuard, device: Any) -> None:
        import torch

        self.guard = guard
        width = guard.window
        units = range(1, guard.max_unit + 1)
        longest = max(guard.span(u) - u for u in units)
        a = torch.full((len(units), longest), width - 1, dtype=torch.long)
        b = torch.full((len(units), longest), width - 1, dtype=torch.long)
        for i, unit in enumerate(units):
            # The tail's last span(unit) tokens have period `unit`: each token equals the one
            # `unit` before it.
            n = guard.span(unit) - unit
            a[i, :n] = torch.arange(width - n, width)
            b[i, :n] = torch.arange(width - n - unit, width - unit)
        self.width = width
        self.a = a.to(device)
        self.b = b.to(device)

    def __call__(self, generated: torch.Tensor) -> torch.Tensor:
        """(B,) bool: rows of `generated` (B, n) whose tail is a loop under the guard."""
        import torch

        batch, n = generated.shape
        width = self.width
        if n >= width:
            tail = generated[:, n - width :].int()
        else:  # distinct negative ids before the first token: no loop reaches into them
            filler = -1 - torch.arange(width - n, device=generated.device, dtype=torch.int32)
            tail = torch.cat([filler.expand(batch, -1), generated.int()], dim=1)
        hits = torch.zeros(batch, dtype=torch.bool, device=generated.device)
        for lo in range(0, batch, GUARD_ROWS):
            rows = tail[lo : lo + GUARD_ROWS]
            same = rows[:, self.a] == rows[:, self.b]  # (rows, units, longest)
            hits[lo : lo + GUARD_ROWS] = same.all(-1).any(-1)
        return hits


def guard_due(guard: RepetitionGuard | None, n: int, min_new: int, max_new: int) -> bool:
    """Whether a guard check runs once `n` tokens are generated: every `guard.every` tokens,
    never before min_new_tokens (a forced length is a forced length) nor at the cap (nothing
    left to save; the row is `max_tokens`)."""
    return guard is not None and n % guard.every == 0 and min_new <= n < max_new


def guard_criteria(
    guard: RepetitionGuard,
    prompt_length: int,
    eos: list[int],
    *,
    min_new: int,
    max_new: int,
) -> Any:
    """A transformers StoppingCriteria that stops looping rows of `generate()` at the token
    counts the fast loop checks; `.stopped` maps row -> tokens generated when it stopped."""
    import torch
    from transformers import StoppingCriteria

    class GuardCriteria(StoppingCriteria):
        def __init__(self) -> None:
            self.stopped: dict[int, int] = {}
            self.finder: LoopFinder | None = None

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            batch = input_ids.shape[0]
            n = input_ids.shape[1] - prompt_length
            done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
            if not guard_due(guard, n, min_new, max_new):
                return done
            if self.finder is None:
                self.finder = LoopFinder(guard, input_ids.device)
            generated = input_ids[:, prompt_length:]
            ended = torch.isin(generated, torch.tensor(eos, device=generated.device)).any(1)
            hits = self.finder(generated) & ~ended
            for row in hits.nonzero().flatten().tolist():
                self.stopped.setdefault(int(row), n)
            return hits

    return GuardCriteria()
