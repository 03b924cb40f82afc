"""The decode step's greedy choice in one pass: penalty, eos ban and argmax over the logits.

Why: the running loop's torch version (`greedy_scores`, then `argmax`) makes a float32 copy of
the (slots, vocab) logits and passes over it about ten times (the penalty's compare, multiply,
divide and two selects, the eos ban's out-of-place `index_copy`, the argmax). With HunyuanOCR's
120,818-token vocabulary that took 571 us at 256 slots and 1,070 at 512 on an H200; these two
kernels (each row's vocabulary in chunks, then the pick) read the model-dtype logits and the
penalty mask once: 114 and 217 us, and a decode step of 250 A4 rows 10.13 ms instead of 10.59
(bench/results/greedy_choice/, bench/results/loop_profile/README.md).

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

# Vocabulary ids a loop iteration reads; a program covers CHUNK ids of one row. One program a
# row over the whole vocabulary ran at 121 us for 8 rows and 163 us for 256 on an H200 (a chain
# of 59 dependent loads each, bench/results/greedy_choice/greedy_choice_h200_one_program.md);
# rows x ceil(vocab / CHUNK) programs keep the loads in flight, and a second kernel picks each
# row's first chunk holding its maximum.
BLOCK = 2048
CHUNK = 4 * BLOCK


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def greedy_chunk_kernel(
        Logits, Seen, Count, MinNew, Eos, Mx, Ix,
        s_l, s_s, vocab, n_eos, penalty, chunks,
        HAS_SEEN: tl.constexpr, EOS_P: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        row64 = row.to(tl.int64)
        banned = tl.load(Count + row) < tl.load(MinNew + row)
        offs_e = tl.arange(0, EOS_P)
        eos = tl.load(Eos + offs_e, mask=offs_e < n_eos, other=-1)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = chunk * CHUNK
        for v0 in range(chunk * CHUNK, tl.minimum(vocab, (chunk + 1) * CHUNK), BLOCK):
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
        tl.store(Mx + row * chunks + chunk, best)
        tl.store(Ix + row * chunks + chunk, best_i)

    @triton.jit
    def greedy_pick_kernel(Mx, Ix, Out, chunks, CP: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, CP)
        ok = offs < chunks
        m = tl.load(Mx + row * chunks + offs, mask=ok, other=float("-inf"))
        j = tl.argmax(m, 0, tie_break_left=True)  # the first chunk with the maximum
        tl.store(Out + row, tl.load(Ix + row * chunks + j).to(tl.int64))

    return greedy_chunk_kernel, greedy_pick_kernel


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
    chunks = -(-vocab // CHUNK)
    dev = logits.device
    mx = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    ix = torch.empty(rows, chunks, dtype=torch.int32, device=dev)
    out = torch.empty(rows, dtype=torch.long, device=dev)
    mask = seen.view(torch.uint8) if seen is not None else logits
    n_eos = eos.numel()
    chunk_kernel, pick_kernel = _kernels()
    chunk_kernel[(rows, chunks)](
        logits, mask, count, min_new, eos, mx, ix,
        logits.stride(0), mask.stride(0) if seen is not None else 0, vocab, n_eos,
        float(penalty), chunks,
        HAS_SEEN=seen is not None, EOS_P=max(2, 1 << (n_eos - 1).bit_length()), BLOCK=BLOCK,
        CHUNK=CHUNK, num_warps=4,
    )
    pick_kernel[(rows,)](mx, ix, out, chunks, CP=max(2, 1 << (chunks - 1).bit_length()),
                         num_warps=1)
    return out
