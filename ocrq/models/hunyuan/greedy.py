"""The decode step's greedy choice in one kernel: penalty, eos ban and argmax over the logits.

Why: the running loop's torch version (`RunningLoop._scores`, then `argmax`) makes a float32 copy
of the (slots, vocab) logits and passes over it about ten times (the penalty's compare, multiply,
divide and two selects, the eos ban's out-of-place `index_copy`, the argmax). With 256 slots and
HunyuanOCR's 120,818-token vocabulary each pass moves ~124 MB; on an H200 they took ~0.55 ms of a
10.3 ms step (bench/results/loop_profile/loop_profile_h200_fp8_w2_r1.json: `where`, unary,
compare, copy and argmax kernels), and they grow with the slots. This reads the model-dtype
logits and the penalty mask once and writes one token a row.

Arithmetic as transformers' processors and the torch path: the logit widened to float32, a seen
id's score times the penalty where negative and divided by it otherwise (IEEE division, as
torch's), the row's eos ids at -inf while its count is below its min_new_tokens, the first
maximum's index (torch's tie rule). Only a NaN score differs (torch's argmax takes it; this skips
it): a model that makes NaN logits has failed anyway.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Vocabulary ids a loop iteration reads per row; 4 warps hold 16 a thread.
BLOCK = 2048


@lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def greedy_kernel(
        Logits, Seen, Count, MinNew, Eos, Out,
        s_l, s_s, vocab, n_eos, penalty,
        HAS_SEEN: tl.constexpr, EOS_P: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        row64 = row.to(tl.int64)
        banned = tl.load(Count + row) < tl.load(MinNew + row)
        offs_e = tl.arange(0, EOS_P)
        eos = tl.load(Eos + offs_e, mask=offs_e < n_eos, other=-1)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int32)
        for v0 in range(0, vocab, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            ok = offs < vocab
            x = tl.load(Logits + row64 * s_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
            if HAS_SEEN:
                seen = tl.load(Seen + row64 * s_s + offs, mask=ok, other=0) != 0
                x = tl.where(seen, tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty)), x)
            is_eos = tl.max((offs[:, None] == eos[None, :]).to(tl.int32), 1) > 0
            x = tl.where(is_eos & banned, float("-inf"), x)
            x = tl.where(ok, x, float("-inf"))
            m = tl.max(x, 0)
            i = tl.argmax(x, 0, tie_break_left=True)
            take = m > best  # strict: an earlier block keeps a tie
            best_i = tl.where(take, v0 + i, best_i)
            best = tl.maximum(best, m)
        tl.store(Out + row, best_i.to(tl.int64))

    return greedy_kernel


def greedy_scores(
    logits: torch.Tensor, seen: torch.Tensor | None, penalty: float, count: torch.Tensor,
    min_new: torch.Tensor, eos: torch.Tensor,
) -> torch.Tensor:
    """Float32 scores (rows, vocab) as transformers' processors make them: the repetition
    penalty over the ids `seen` marks (None: no penalty), eos banned in rows whose `count` is
    below their `min_new`. Their argmax is `greedy_next`'s token (the CPU's and the torch
    attention's path, and its reference)."""
    import torch

    scores = logits.float()
    if seen is not None:
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty),
                             scores)
    banned = (count < min_new)[:, None]
    eos_scores = scores.index_select(1, eos)
    return scores.index_copy(
        1, eos, torch.where(banned, torch.full_like(eos_scores, float("-inf")), eos_scores)
    )


def greedy_next(
    logits: torch.Tensor, seen: torch.Tensor | None, penalty: float, count: torch.Tensor,
    min_new: torch.Tensor, eos: torch.Tensor,
) -> torch.Tensor:
    """`greedy_scores(...).argmax(-1)` in one pass: each row's next token (rows,) int64 from
    `logits` (rows, vocab) in the model's dtype, unit stride along the vocabulary."""
    import torch

    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits need unit stride along the vocabulary")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    mask = seen.view(torch.uint8) if seen is not None else logits
    n_eos = eos.numel()
    _kernel()[(rows,)](
        logits, mask, count, min_new, eos, out,
        logits.stride(0), mask.stride(0) if seen is not None else 0, vocab, n_eos,
        float(penalty),
        HAS_SEEN=seen is not None, EOS_P=max(2, 1 << (n_eos - 1).bit_length()), BLOCK=BLOCK,
        num_warps=4,
    )
    return out
