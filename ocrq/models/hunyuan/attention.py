"""Attention for one decode step over a static KV cache: each row's real keys read once.

Why a kernel of our own: at batch >= 64 the decode step of HunyuanOCR is bound by reading the KV
cache (96 KiB per token, ~8 GB per step at batch 64 of 1024² pages). transformers' sdpa path
passes a padding mask, which rules out the flash backend and makes it expand the 8 KV heads to
16 (`repeat_kv`: the cache is read, written twice as large and read again), and a static cache
padded to its full length is read whole every step. Here:

* `attend_torch` is the reference (CPU, tests, any device without Triton): sdpa with
  `enable_gqa=True` and a boolean key mask. Inside a CUDA graph it reads the whole static cache;
  eagerly the caller slices the cache to the current length first.
* `attend_triton` is split-K "flash decoding": one program per (row, KV head, key range) loads
  each K/V block once and scores it against all query heads of its group (GQA as a small matrix
  product, no expansion); a second tiny kernel merges the ranges with their softmax statistics.
  The key range of each row is [start[row], end) with `end` read from device memory, so a CUDA
  graph captured once serves every step of a batch while reading only keys written so far, and
  left padding is skipped instead of masked.

Triton is imported lazily so that this module imports on hosts without it; set TRITON_INTERPRET=1
before the first import to run the kernels on the CPU (tests do, in a subprocess).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def attend_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Reference decode attention.

    q (B, H, D); k, v (B, KVH, L, D), in q's dtype or fp8 (widened here, as the kernel
    widens them); valid (B, L) bool, True on keys a row may see. Returns (B, H, D) in q's dtype.
    """
    import torch.nn.functional as F

    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)

    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the split kernel (the bench may try others)."""

    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4  # split the key range until about this many programs run per SM
    # Scores in log2 units, exponentials by exp2: the softmax scale times log2(e) folded into q
    # where q is converted anyway (fp8 pools, fp32), into the scores otherwise. tl.exp is exp2
    # of x * log2(e), one multiply a score more; folding saves it and the scale's multiply (sm_90
    # SASS: 747 -> 660 instructions a 128-key iteration of the fp8 pool, kv_sass_sm90.md). On an
    # H200 it timed the same, alone and in the service (kv_attention/README.md); kept as the
    # default for its fewer instructions, False for the bench's side-by-side runs.
    exp2: bool = True
    # Key ranges split within each row's own keys [start, end), so every split of every row has
    # work. False: splits are fixed column ranges of the cache, as before: in the running loop's
    # pool a row's keys then fall in one or two of them, and with few rows most programs are
    # idle (8 rows: ~9 splits, 1-2 working; bench/results/loop_profile/README.md).
    row_splits: bool = True
    # An fp8 pool multiplied in fp8 (Hopper's e4m3 tensor-core products): the queries rounded to
    # e4m3 for the first product, the probabilities (times P_SCALE, kept in e4m3's normal range)
    # for the second, so the keys and values are used as stored, with no conversion. Why: the
    # fp8 kernel reached ~77% of its bandwidth floor where bf16 reaches 95%
    # (bench/results/loop_profile/README.md); its extra work per byte is the widening of every
    # key and value to fp16 and products over twice the elements a byte holds. The price is two
    # more roundings (vLLM's FlashAttention-3 path with an fp8 cache also rounds its queries):
    # off by default, its error measured beside its time (bench/kv_attention.py --fp8-products).
    fp8_products: bool = False


DEFAULT_CONFIG = KernelConfig()
# An fp8 pool, which the running loop stores with its values transposed and reads padded: 128
# keys a loop iteration over 4 warps. On an H200, 400 rows at contexts of 2,824 +-20%: 577 us a
# layer against 636-644 us for the token-major pool at its best config (64 keys over 2 warps),
# every other config slower (bench/results/kv_attention/kv_attention_h200_pool_configs.md).
# bf16 pools stay token-major at the default: transposed they were 5-9% slower at every config.
FP8_CONFIG = KernelConfig(block_n=128, num_warps=4)
# Keys past the end a padded pool keeps readable (TritonDecodeAttention's `padded`): a block of
# up to this many keys may start at the last key written.
PAD_KEYS = 256
LOG2E = math.log2(math.e)
# fp8_products: probabilities in [0, 1] times this before their e4m3 rounding (normal down to
# 2^-14 instead of 2^-6); the sums they are divided by carry the same factor.
P_SCALE = 256.0


def dtype_constants(config: KernelConfig, upcast: bool, cast_kv: bool) -> dict[str, Any]:
    """The split kernel's constexprs that follow from the config and the operands' dtypes:
    `upcast` a float32 query (the CPU's interpreter), `cast_kv` a pool of another dtype than
    the query (fp8). One place for the launch and for bench/kv_sass.py, which compiles the
    kernel without launching it (a copy of these rules there fell behind once)."""
    f8dot = config.fp8_products and cast_kv and not upcast
    return {
        "UPCAST": upcast, "CAST_KV": cast_kv, "EXP2": config.exp2,
        "FOLD_Q": config.exp2 and (upcast or cast_kv) and not f8dot,
        "ROW_SPLITS": config.row_splits, "F8DOT": f8dot, "P_SCALE": P_SCALE if f8dot else 1.0,
    }


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    """Define the two kernels on first use (triton's jit needs triton at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, K, V, Start, End, Acc, Mx, Sm, Out,
        s_qb, s_qh, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_vd,
        s_ab, s_ah, s_as, s_mb, s_mh, s_ob, s_oh, s_eb,
        scale, split_len,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, SINGLE: tl.constexpr, CAST_KV: tl.constexpr, PADDED: tl.constexpr,
        EXP2: tl.constexpr, FOLD_Q: tl.constexpr, ROW_SPLITS: tl.constexpr,
        F8DOT: tl.constexpr, P_SCALE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        start = tl.load(Start + b)
        end = tl.load(End + b * s_eb)
        if ROW_SPLITS:  # this row's keys in num_programs(2) ranges of whole blocks
            per = tl.cdiv(tl.cdiv(end - start, tl.num_programs(2)), BLOCK_N) * BLOCK_N
            lo = start + s * per
            hi = tl.minimum(end, lo + per)
        else:
            lo = tl.maximum(start, s * split_len)
            hi = tl.minimum(end, (s + 1) * split_len)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        heads = kvh * G + offs_g
        g_ok = offs_g < G
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=g_ok[:, None],
                    other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # An fp8 pool is multiplied in fp16: converting each loaded byte to bf16 takes two
        # conversions (through fp16), which capped the kernel at ~2.5 TB/s of fp8 on an H200
        # (bench/results/kv_attention/kv_attention_h200_before.md); one to fp16 does not. q after
        # its RMSNorm is far inside fp16's range, and fp16 keeps more of its bits than bf16.
        q16 = q.to(tl.float16)
        # EXP2 (KernelConfig.exp2): `scale` comes times log2(e), scores are in log2 units. It is
        # folded into q where q is converted anyway (FOLD_Q), from fp32 so rounded once; a bf16
        # q is used as stored and its scores scaled.
        if FOLD_Q:
            q16 = (q.to(tl.float32) * scale).to(tl.float16)
            if UPCAST:
                q = q * scale
        if F8DOT:  # unscaled: after its RMSNorm a query lies in e4m3's normal range (scaled, not)
            q8 = q.to(tl.float32).to(K.dtype.element_ty)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        # 64-bit offsets: a pool's KV head spans width x D values, and 8 heads of a 2.4 M-token
        # fp8 pool pass 2^31 (an illegal address on the H200 before this cast).
        b64, kvh64 = b.to(tl.int64), kvh.to(tl.int64)
        k_base = K + b64 * s_kb + kvh64 * s_kh
        v_base = V + b64 * s_vb + kvh64 * s_vh
        # A padded pool (see TritonDecodeAttention): blocks start at a multiple of 16 keys and
        # load unmasked, so values that lie key after key (s_vl == 1) are read in 16-byte
        # vectors; the keys outside [lo, hi) are masked in the scores instead.
        first = lo
        stop = hi
        if PADDED:
            first = tl.multiple_of((lo // 16) * 16, 16)
            # A range past the row's end stays empty: started at the boundary below it, it
            # would be one block of masked keys, its maximum -inf and exp2(-inf - -inf) NaN
            # (row splits: a row of 127 keys from key 14 in two ranges of 128 did that).
            stop = tl.where(lo < hi, hi, first)
        for n0 in range(first, stop, BLOCK_N):
            if PADDED:
                n0 = tl.multiple_of(n0, 16)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            if PADDED:
                n_ok = (offs_n >= lo) & (offs_n < hi)
                k = tl.load(k_base + offs_n[:, None] * s_kl + offs_d[None, :])
            else:
                n_ok = offs_n < hi
                k = tl.load(k_base + offs_n[:, None] * s_kl + offs_d[None, :],
                            mask=n_ok[:, None], other=0.0)
            if UPCAST:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif F8DOT:
                scores = tl.dot(q8, tl.trans(k))
            elif CAST_KV:  # an fp8 pool: one conversion to fp16 (fp8 -> bf16 is two)
                scores = tl.dot(q16, tl.trans(k.to(tl.float16)))
            else:
                scores = tl.dot(q, tl.trans(k))
            if not FOLD_Q:
                scores = scores * scale
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            if EXP2:
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(scores - m_new[:, None])
            else:
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1) * P_SCALE  # P_SCALE 1.0 unless F8DOT
            v_at = v_base + offs_n[:, None] * s_vl + offs_d[None, :] * s_vd
            # padded: finite there (see TritonDecodeAttention), so p = 0 keeps it out
            v = tl.load(v_at) if PADDED else tl.load(v_at, mask=n_ok[:, None], other=0.0)
            if UPCAST:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif F8DOT:
                pv = tl.dot((p * P_SCALE).to(V.dtype.element_ty), v)
            elif CAST_KV:
                pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SINGLE:  # one key range: normalise here, no merge kernel
            out = acc / l_i[:, None]
            tl.store(Out + b * s_ob + heads[:, None] * s_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=g_ok[:, None])
        else:
            tl.store(Acc + b * s_ab + heads[:, None] * s_ah + s * s_as + offs_d[None, :], acc,
                     mask=g_ok[:, None])
            tl.store(Mx + b * s_mb + heads * s_mh + s, m_i, mask=g_ok)
            tl.store(Sm + b * s_mb + heads * s_mh + s, l_i, mask=g_ok)

    @triton.jit
    def merge_kernel(
        Acc, Mx, Sm, Out,
        s_ab, s_ah, s_as, s_mb, s_mh, s_ob, s_oh,
        S, SP: tl.constexpr, D: tl.constexpr, EXP2: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SP)
        offs_d = tl.arange(0, D)
        s_ok = offs_s < S
        m = tl.load(Mx + b * s_mb + h * s_mh + offs_s, mask=s_ok, other=float("-inf"))
        l_s = tl.load(Sm + b * s_mb + h * s_mh + offs_s, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        # empty ranges: exp(-inf) = 0; maxima in log2 units when the split kernel's EXP2
        w = tl.where(s_ok, tl.exp2(m - m_max) if EXP2 else tl.exp(m - m_max), 0.0)
        denom = tl.sum(w * l_s, 0)
        acc = tl.load(Acc + b * s_ab + h * s_ah + offs_s[:, None] * s_as + offs_d[None, :],
                      mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / denom
        tl.store(Out + b * s_ob + h * s_oh + offs_d, out.to(Out.dtype.element_ty))

    return split_kernel, merge_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class TritonDecodeAttention:
    """Split-K decode attention for one batch shape: buffers sized once, so it can be graphed.

    `start` (B,) int32: first key of each row (left padding skipped); `end` (1,) int32: one past
    the last key written, the same for every row since rows advance in lockstep; or `end` (B,):
    each row's own (the running loop, whose rows live at their own offsets of one KV pool that
    is passed expanded over the rows with batch stride 0).

    `padded`: the caller promises PAD_KEYS readable keys past `cache_len` and finite values
    at every key (the running loop's fp8 pool: zeroed at allocation, written only with
    saturated values). Blocks then load unmasked from 16-key boundaries, which is what lets
    values stored transposed (unit stride along L) be read in vectors. Why transposed: values
    laid out token-major reach the second product of an fp8 pool only through one-byte
    shared-memory loads (Hopper has no transposing load for 8-bit data), 128 a thread for every
    64 keys; transposed and padded, a loop iteration compiles to 722 instructions instead of
    1,106 (sm_90 SASS, bench/results/kv_attention/kv_sass_sm90.md) and a layer of 400 rows
    takes 577 us instead of 636-644 on an H200 (FP8_CONFIG).
    """

    def __init__(self, batch: int, heads: int, kv_heads: int, head_dim: int, cache_len: int,
                 device: Any, config: KernelConfig = DEFAULT_CONFIG, sm_count: int | None = None,
                 padded: bool = False) -> None:
        import torch

        if padded and config.block_n > PAD_KEYS:
            raise ValueError(f"block_n {config.block_n} reads past the pool's {PAD_KEYS} "
                             "padding keys")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
        if head_dim != _pow2(head_dim) or head_dim < 16:
            raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
        self.group = heads // kv_heads
        self.group_pad = max(16, _pow2(self.group))  # tl.dot needs >= 16 rows
        self.config = config
        if sm_count is None:
            sm_count = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if torch.device(device).type == "cuda" else 4
            )
        programs = batch * kv_heads
        splits = max(1, min(-(-config.programs_per_sm * sm_count // programs),
                            -(-cache_len // (4 * config.block_n))))
        per_split = -(-cache_len // splits)
        self.split_len = -(-per_split // config.block_n) * config.block_n
        self.splits = -(-cache_len // self.split_len)
        self.grid = (batch, kv_heads, self.splits)
        self.heads, self.head_dim = heads, head_dim
        self.padded = padded
        f32 = torch.float32
        self.acc = torch.empty(batch, heads, self.splits, head_dim, dtype=f32, device=device)
        self.mx = torch.empty(batch, heads, self.splits, dtype=f32, device=device)
        self.sm = torch.empty(batch, heads, self.splits, dtype=f32, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, H, D) with unit last stride; k, v (B, KVH, L, D), in q's dtype or fp8 (the
        running loop's `OCRQ_KV_CACHE_DTYPE=fp8` pool); k with unit last stride, v with unit
        stride along D or along L (a transposed pool); returns (B, H, D) in q's dtype."""
        import torch

        if k.stride(3) != 1 or 1 not in (v.stride(2), v.stride(3)):
            raise ValueError("keys need unit stride along D, values along D or L")

        split_kernel, merge_kernel = _kernels()
        out = torch.empty_like(q)
        c = self.config
        single = self.splits == 1
        # e4m3 products need keys and values of one dtype; else both are widened
        kc = c if k.dtype == v.dtype else replace(c, fp8_products=False)
        split_kernel[self.grid](
            q, k, v, start, end, self.acc, self.mx, self.sm, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), v.stride(3),
            self.acc.stride(0), self.acc.stride(1), self.acc.stride(2),
            self.mx.stride(0), self.mx.stride(1), out.stride(0), out.stride(1),
            end.stride(0) if end.numel() > 1 else 0,
            scale * LOG2E if c.exp2 else scale, self.split_len,
            G=self.group, GP=self.group_pad, D=self.head_dim, BLOCK_N=c.block_n,
            SINGLE=single, PADDED=self.padded,
            **dtype_constants(kc, q.dtype == torch.float32, k.dtype != q.dtype),
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
        if single:
            return out
        merge_kernel[(q.shape[0], self.heads)](
            self.acc, self.mx, self.sm, out,
            self.acc.stride(0), self.acc.stride(1), self.acc.stride(2),
            self.mx.stride(0), self.mx.stride(1), out.stride(0), out.stride(1),
            self.splits, SP=_pow2(self.splits), D=self.head_dim, EXP2=c.exp2,
            num_warps=1,
        )
        return out
