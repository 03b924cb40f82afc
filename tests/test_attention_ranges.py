"""The running loop's decode attention over a padded fp8 pool, at every kind of key range a row can
have: each row's output equals torch's attention over its keys, and none is NaN.

Why a sweep: with row splits, a row's keys are cut into ranges of whole blocks; a range past the
row's end whose start rounds down below the end (a row of 127 keys from key 14, two ranges of
128) once ran one block of masked keys, took exp2(-inf - -inf) and made the row's output NaN, on
the fp8 pool only (its padded loads; tests/test_fused_step.py checks the fused step's copy of the
rule). Triton's interpreter on the CPU, in a subprocess (the interpreter is chosen when triton is
first imported).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreter import interpret

pytestmark = pytest.mark.hunyuan


CHECK = textwrap.dedent(
    """
    import torch
    from ocrq.models.hunyuan.attention import (
        FP8_CONFIG, PAD_KEYS, TritonDecodeAttention, attend_torch)
    from ocrq.models.hunyuan.kv_cache import padded_width, to_cache, zero_pool

    torch.manual_seed(0)
    H, KVH, D, L = 4, 2, 32, 2048  # the kernel cuts ranges for a pool this long
    W = padded_width(L, PAD_KEYS)
    fp8 = torch.float8_e4m3fn
    k = zero_pool(KVH, W, D, fp8, "cpu")
    v = zero_pool(KVH, W, D, fp8, "cpu", transposed=True)
    k.copy_(to_cache(torch.randn(k.shape), fp8))
    v.copy_(to_cache(torch.randn(v.shape), fp8))
    # (start, end) of each row: 127 keys from 14 (the NaN above), ranges ending just past a
    # 16-key boundary, one key, a block exactly, and a spread
    ranges = [(14, 141), (14, 75), (0, 64), (0, 1), (3, 200), (30, 47), (100, 229), (7, 390),
              (128, 129), (15, 143), (1, 130), (50, 305)]
    worst, nan = 0.0, 0
    for splits_sms in (8, 64):
        kern = TritonDecodeAttention(len(ranges), H, KVH, D, L, "cpu", FP8_CONFIG,
                                     sm_count=splits_sms, padded=True)
        B = len(ranges)
        q = torch.randn(B, H, D)
        start = torch.tensor([a for a, _ in ranges], dtype=torch.int32)
        end = torch.tensor([b for _, b in ranges], dtype=torch.int32)
        shape = (B, KVH, W, D)
        out = kern(q, k.expand(shape), v.expand(shape), start, end, 0.2)
        seen = torch.zeros(B, W, dtype=torch.bool)
        for i, (a, b) in enumerate(ranges):
            seen[i, a:b] = True
        ref = attend_torch(q, k.float().expand(shape), v.float().expand(shape), seen, 0.2)
        nan += int(torch.isnan(out).any(-1).any(-1).sum())
        worst = max(worst, float((out.float() - ref).abs().nan_to_num(1e9).max()))
        print("splits", kern.splits)
    print("attention", nan, worst)
    """
)


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return interpret(CHECK)


def test_every_range_equals_torch_and_none_is_nan(lines: list[str]) -> None:
    splits = [int(ln.split()[1]) for ln in lines if ln.startswith("splits")]
    assert max(splits) > 1, splits  # rows cut into ranges, some past their rows' ends
    nan, worst = next(ln for ln in lines if ln.startswith("attention")).split()[1:]
    assert int(nan) == 0
    assert float(worst) < 1e-4, worst
