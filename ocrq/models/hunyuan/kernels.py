"""Fused elementwise kernels for the graphed decode step (Triton; CUDA, or its CPU interpreter).

Why: once the step runs as a CUDA graph, its cost at batch 64 is half kernel count. A profile
(bench/results/decode_speed/decode_profile_h200.md) shows ~1,530 kernels per step, ~64 per layer,
most of them the small float32 casts, multiplies, means and concatenations of transformers' RMSNorm
and RoPE, each ~2 us however little it does. Three kernels replace them:

* `add_rms_norm`: residual add (optional) + RMSNorm, writing both the new residual stream and the
  normalised row (transformers: `residual + h`, then `weight * (h * rsqrt(mean(h²) + eps))`);
* `rope_rms_norm`: RoPE + the per-head query/key RMSNorm HunYuan applies after it, optionally
  writing the result (and the value row) straight into the static KV cache at the step's slot.

Each kernel rounds where transformers rounds (to the model dtype after the RoPE, after the
normalisation, after the weight multiply), so outputs match the module-by-module path to the
last bit in most elements and within one rounding step otherwise (fused multiply-adds).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        X, R, W, Out, H, n_cols, eps, s_x, s_r, s_o, s_h,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + row * s_x + cols, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * s_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(H + row * s_h + cols, x, mask=ok)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + row * s_o + cols, (w * y).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def rope_rms_norm_kernel(
        X, Cos, Sin, W, Out, Slot, V, VOut, heads, eps,
        s_xb, s_xh, s_cb, s_ob, s_oh, s_ol, s_vb, s_vh, s_vob, s_voh, s_vol, s_vod, s_sb,
        HALF: tl.constexpr, TO_SLOT: tl.constexpr, COPY_V: tl.constexpr, SAT: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // heads
        h = pid % heads
        offs = tl.arange(0, HALF)
        x_row = X + b * s_xb + h * s_xh
        x1 = tl.load(x_row + offs).to(tl.float32)
        x2 = tl.load(x_row + HALF + offs).to(tl.float32)
        c1 = tl.load(Cos + b * s_cb + offs)
        c2 = tl.load(Cos + b * s_cb + HALF + offs)
        n1 = tl.load(Sin + b * s_cb + offs)
        n2 = tl.load(Sin + b * s_cb + HALF + offs)
        dtype = X.dtype.element_ty
        r1 = (x1 * c1 + (-x2) * n1).to(dtype).to(tl.float32)
        r2 = (x2 * c2 + x1 * n2).to(dtype).to(tl.float32)
        var = (tl.sum(r1 * r1, 0) + tl.sum(r2 * r2, 0)) / (2 * HALF)
        rs = tl.rsqrt(var + eps)
        y1 = (r1 * rs).to(dtype).to(tl.float32)
        y2 = (r2 * rs).to(dtype).to(tl.float32)
        w1 = tl.load(W + offs).to(tl.float32)
        w2 = tl.load(W + HALF + offs).to(tl.float32)
        b64, h64 = b.to(tl.int64), h.to(tl.int64)  # a pool's head spans > 2^31 values at most
        out = Out + b64 * s_ob + h64 * s_oh
        if TO_SLOT:
            slot = tl.load(Slot + b * s_sb)
            out += slot * s_ol
        k1 = (w1 * y1).to(dtype)  # the model's rounding first, as the prefill's keys have it
        k2 = (w2 * y2).to(dtype)
        if SAT:  # an fp8 cache: saturate as `to_cache` does (ocrq/models/hunyuan/kv_cache.py)
            k1 = tl.minimum(tl.maximum(k1.to(tl.float32), -FP8_MAX), FP8_MAX)
            k2 = tl.minimum(tl.maximum(k2.to(tl.float32), -FP8_MAX), FP8_MAX)
        tl.store(out + offs, k1.to(Out.dtype.element_ty))
        tl.store(out + HALF + offs, k2.to(Out.dtype.element_ty))
        if COPY_V:
            v_row = V + b * s_vb + h * s_vh
            v_out = VOut + b64 * s_vob + h64 * s_voh + tl.load(Slot + b * s_sb) * s_vol
            v1 = tl.load(v_row + offs)
            v2 = tl.load(v_row + HALF + offs)
            if SAT:
                v1 = tl.minimum(tl.maximum(v1.to(tl.float32), -FP8_MAX), FP8_MAX)
                v2 = tl.minimum(tl.maximum(v2.to(tl.float32), -FP8_MAX), FP8_MAX)
            tl.store(v_out + offs * s_vod, v1.to(VOut.dtype.element_ty))
            tl.store(v_out + (HALF + offs) * s_vod, v2.to(VOut.dtype.element_ty))

    return add_rms_norm_kernel, rope_rms_norm_kernel


@lru_cache(maxsize=1)
def _silu_mul_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(GU, Out, n, s_g, s_o, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(GU + row * s_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * s_g + n + cols, mask=ok, other=0.0)
        # torch's silu: x / (1 + exp(-x)) in float32 (expf, IEEE division), then the dtype;
        # the product in float32 of the two rounded operands, then the dtype
        act = tl.math.div_rn(g, 1.0 + tl.math.exp(-g)).to(GU.dtype.element_ty)
        y = act.to(tl.float32) * u.to(tl.float32)
        tl.store(Out + row * s_o + cols, y.to(Out.dtype.element_ty), mask=ok)

    return silu_mul_kernel


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` (rows, 2n): the merged gate and up projections' output
    (ocrq/models/hunyuan/merged.py), rounded as transformers' `act_fn(gate) * up` rounds."""
    import torch

    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel()[(rows, -(-n // block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
    )
    return out


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm of it) for x (rows, n); without a residual, (x, RMSNorm(x))."""
    import torch

    kernel, _ = _kernels()
    out = torch.empty_like(x)
    new = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    kernel[(x.shape[0],)](
        x, r, weight, out, new, x.shape[1], eps,
        x.stride(0), r.stride(0), out.stride(0), new.stride(0),
        HAS_RES=residual is not None, BLOCK=_pow2(x.shape[1]), num_warps=4,
    )
    return new, out


def rope_rms_norm(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, eps: float,
    *, cache: torch.Tensor | None = None, slot: torch.Tensor | None = None,
    v: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """RoPE then per-head RMSNorm of x (B, heads, D); cos, sin (B, D) float32.

    Returns the result, or with `cache` (B, heads, L, D) and `slot` (1,) writes it into the cache
    at that column (and `v` into `v_cache` there, whose values may lie transposed: any strides)
    and returns None. An fp8 cache gets both saturated and rounded to it
    (ocrq/models/hunyuan/kv_cache.py). A `slot` of shape (B,) gives each row its own column
    (the running loop's pool, ocrq/models/hunyuan/running.py: there the cache is one pool
    expanded over the rows, batch stride 0).
    """
    import torch

    from ocrq.models.hunyuan.kv_cache import FP8_MAX, is_fp8

    _, kernel = _kernels()
    batch, heads, dim = x.shape
    to_slot = cache is not None
    out = cache if to_slot else torch.empty_like(x)
    s_ol = out.stride(2) if to_slot else 0
    copy_v = v is not None
    vv = v if copy_v else x
    vo = v_cache if copy_v else out
    kernel[(batch * heads,)](
        x, cos, sin, weight, out, slot if to_slot else x, vv, vo, heads, eps,
        x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1), s_ol,
        vv.stride(0), vv.stride(1), vo.stride(0), vo.stride(1), vo.stride(2) if copy_v else 0,
        vo.stride(3) if copy_v else 1,
        slot.stride(0) if to_slot and slot is not None and slot.numel() > 1 else 0,
        HALF=dim // 2, TO_SLOT=to_slot, COPY_V=copy_v, SAT=is_fp8(out.dtype),
        FP8_MAX=FP8_MAX, num_warps=1,
    )
    return None if to_slot else out
