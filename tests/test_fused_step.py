"""The fused few-row decode step (ocrq/models/hunyuan/fused_step.py) against today's step, on the
CPU in Triton's interpreter (a subprocess: the interpreter is chosen when triton is first
imported).

One tiny random HunYuanVL 1.5 (float32), one KV pool per layer holding random old keys for three
rows at their own ranges (one row with none: only its new key), positions past the prompt as the
running loop feeds them. The fused step must give the logits of the module-by-module step with
torch attention (`TextModel.step(fused=False, pooled=True)`) and of today's fused step with the
split Triton attention, and write the same keys and values into the pool; with key ranges split
two ways (the merge by the last program) and not split. An fp8 pool with transposed values
(the running loop's) is compared with today's step over the same pool. The checks can fail:
other tokens, a RoPE position off by one and a row that loses its first key each move the
logits by orders of magnitude more than the tolerance.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreter import interpret

pytestmark = pytest.mark.hunyuan

# float32 on the CPU: the paths differ by ~1e-5 (summation order); a broken step by > 1.
TOLERANCE = 1e-3

CHECK = textwrap.dedent(
    """
    import torch
    from transformers import HunYuanVLForConditionalGeneration
    from ocrq.testing.tiny_hunyuan import TINY_1_5, build_config
    from ocrq.models.hunyuan.text import TextModel
    from ocrq.models.hunyuan.attention import attend_torch, TritonDecodeAttention
    from ocrq.models.hunyuan.kv_cache import zero_pool, to_cache
    from ocrq.models.hunyuan.fused_step import (
        FusedConfig, FusedStep, FusedWeights, fused_decode_step)

    torch.manual_seed(0)
    model = HunYuanVLForConditionalGeneration._from_config(
        build_config(TINY_1_5), dtype=torch.float32).eval()
    text = TextModel(model)
    H, KVH, D, L, WIDTH, B = text.heads, text.kv_heads, text.head_dim, len(text.layers), 384, 3
    starts = torch.tensor([0, 40, 130], dtype=torch.int32)
    ends = torch.tensor([30, 107, 131], dtype=torch.int32)  # the last row: its new key only
    col = (ends - 1).long()
    weights = FusedWeights.from_text(text)

    def pools(dtype, transposed):
        g = torch.Generator().manual_seed(1)
        ks, vs = [], []
        for _ in range(L):
            k = zero_pool(KVH, WIDTH, D, dtype, "cpu")
            v = zero_pool(KVH, WIDTH, D, dtype, "cpu", transposed=transposed)
            k.copy_(to_cache(torch.randn(k.shape, generator=g) * 2, dtype))
            v.copy_(to_cache(torch.randn(v.shape, generator=g) * 2, dtype))
            ks.append(k)
            vs.append(v)
        return ks, vs

    def clone(ps):
        out = []
        for p in ps:
            c = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
            c.copy_(p)
            out.append(c)
        return out

    def today(tok, pos, ks, vs, triton):
        valid = torch.zeros(B, WIDTH, dtype=torch.bool)
        for b in range(B):
            valid[b, starts[b]:ends[b]] = True
        kern = TritonDecodeAttention(B, H, KVH, D, WIDTH, "cpu")

        def attend(q, kc, vc):
            shape = (B, *kc.shape[1:])
            if triton:
                return kern(q, kc.expand(shape), vc.expand(shape), starts, ends, text.scale)
            return attend_torch(q, kc.expand(shape), vc.expand(shape), valid, text.scale)

        with torch.inference_mode():
            return text.step(tok, pos, col, ks, vs, attend, triton, pooled=True).float()

    def fused(tok, pos, ks, vs, programs, start=starts, block_k=1024, padded=False):
        config = FusedConfig(attn_programs=programs, block_k=block_k)
        step = FusedStep(weights, B, "cpu", config, padded=padded)
        with torch.inference_mode():
            out = fused_decode_step(text, step, tok, pos, col, start, ends, ks, vs).float()
        return out, step.splits

    def kv_diff(a, b):
        return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))

    tok = torch.tensor([11, 57, 200])
    pos = torch.tensor([60, 95, 170]).repeat(text.axes, 1)
    ks, vs = pools(torch.float32, False)
    rk, rv = clone(ks), clone(vs)
    ref = today(tok, pos, rk, rv, False)
    triton_ref = today(tok, pos, clone(ks), clone(vs), True)
    fk, fv = clone(ks), clone(vs)
    # the norm's row in two tiles; whole key blocks from 16-key boundaries (the loop's pool)
    out, splits = fused(tok, pos, fk, fv, 12, block_k=32, padded=True)
    print("f32", splits, float((out - ref).abs().max()), float((out - triton_ref).abs().max()),
          kv_diff(rk + rv, fk + fv), float(ref.abs().max()))
    unpadded, _ = fused(tok, pos, clone(ks), clone(vs), 12)
    print("unpadded", float((unpadded - ref).abs().max()))
    other, _ = fused(torch.tensor([12, 90, 3]), pos, clone(ks), clone(vs), 1)
    print("distinct", float((other - ref).abs().max()))
    shifted, _ = fused(tok, pos + 1, clone(ks), clone(vs), 1)
    print("shifted", float((shifted - ref).abs().max()))
    lost, _ = fused(tok, pos, clone(ks), clone(vs), 1, starts + torch.tensor([0, 1, 0],
                                                                       dtype=torch.int32))
    print("lost", float((lost - ref).abs().max()))

    ks, vs = pools(torch.float8_e4m3fn, True)
    tk, tv = clone(ks), clone(vs)
    ref8 = today(tok, pos, tk, tv, True)
    fk, fv = clone(ks), clone(vs)
    out8, splits = fused(tok, pos, fk, fv, 12, padded=True)
    print("fp8", splits, int(fv[0].stride(2) == 1), float((out8 - ref8).abs().max()),
          kv_diff(tk + tv, fk + fv))
    """
)


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return interpret(CHECK)


def value(lines: list[str], name: str) -> list[float]:
    return [float(x) for x in next(ln for ln in lines if ln.startswith(name + " ")).split()[1:]]


def test_fused_step_equals_todays_step(lines: list[str]) -> None:
    splits, vs_modules, vs_today, kv, scale = value(lines, "f32")
    assert splits == 2  # the ranges merged by the last program to finish
    assert vs_modules < TOLERANCE and vs_today < TOLERANCE, (vs_modules, vs_today)
    assert kv < 1e-5  # the same new keys and values at the same columns
    (unpadded,) = value(lines, "unpadded")  # key blocks masked at the range's ends
    assert unpadded < TOLERANCE, unpadded
    assert scale > 1.0  # logits far from zero: the tolerance is small against them


def test_fused_step_on_the_fp8_pool(lines: list[str]) -> None:
    splits, transposed, diff, kv = value(lines, "fp8")
    assert splits == 2 and transposed == 1
    assert diff < TOLERANCE and kv == 0.0, (diff, kv)


def test_the_check_can_fail(lines: list[str]) -> None:
    for name in ("distinct", "shifted", "lost"):
        (diff,) = value(lines, name)
        assert diff > 100 * TOLERANCE, (name, diff)
