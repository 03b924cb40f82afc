"""A decode step for a few rows in five kernels a layer: each weight streamed once by many CTAs.

Why: a step of the interactive lane (1-8 rows, ~1k keys each) must read the text decoder's
weights once, ~1.08 GB (24 layers of 34.6 MB, plus the 247 MB lm_head), 0.32 ms at an H100's
3.35 TB/s. Today's step (ocrq/models/hunyuan/text.py `_layers_fused` + the split decode
attention) took 1.41 ms there: ~370 kernels, most of them tiny (norms, RoPE, casts, the
attention's merge), each paying its launch ramp and tail inside the CUDA graph, and cuBLAS GEMMs
that at M = 1-8 leave SMs idle. Here a layer is five kernels, each a GEMV-shaped pass over one
weight by hundreds of programs (every SM streams weights), with the small work folded into
their prologues and epilogues:

1. `norm_gemv` (QKV): residual add of the last layer's down projection + RMSNorm, recomputed
   by every program from the (L2-resident) residual row, then the merged q/k/v projection for
   its columns. Why fused: the norm's output is 2 KB a row; a kernel of its own costs more in
   launch and tail than the whole computation. The first layer gathers the embedding row here.
2. `attention`: per (row, KV head, key range): RoPE + the per-head RMSNorm of the group's
   queries and of the new key, the new key and value written into the pool (range 0), the
   pool's old keys [start, end - 1) and the new one attended (GQA group together, as the
   running loop's split kernel does), and the ranges merged by the last program to finish
   (a counter per row and KV head), so no merge kernel. Why: RoPE/norm/KV-write are a few
   hundred values per head; the attention program needs exactly them.
3. `gemv_splitk` (O projection): split over K as well as N, so 1024 output columns still give
   hundreds of programs; partial sums added in float32 (atomics) into a zeroed buffer.
4. `norm_gemv` with GATE (gate/up): the residual add of (3) + RMSNorm in the prologue, gate
   and up columns of the merged weight side by side, SiLU(gate) * up in the epilogue.
5. `gemv_splitk` (down), its float32 sum read by the next layer's (1) or the final norm +
   lm_head (1 again, over the vocabulary).

Each place rounds where transformers rounds (the residual, the norm, each projection's output,
RoPE, SiLU) so logits match today's step within a few bf16 roundings; float32 sums over split
ranges differ from cuBLAS's only in order.

Layout as the running loop keeps it (ocrq/models/hunyuan/running.py): one pool per layer,
(1, KV heads, width, D), keys token-major, values token-major (bf16) or transposed (fp8, any
strides work); row r reads [start_r, end_r) and writes column col_r = end_r - 1.

Wired as a lab lever, off by default (OCRQ_LOOP_FUSED_STEP_ROWS=N, N <= 16): the running loop's
`LoopRunner.step(k)` over a bucket of k <= N slots takes its logits from `fused_decode_step`,
one `FusedStep(FusedWeights.from_text(text), k, device, padded=<the fp8 pool's>)` a bucket,
instead of `text.step(...)`; its start/end/col are what the kernels read. Where it does not fit
the loop (torch attention, fp8 products, unmerged weights) it stays off with a start-up warning
(ocrq/models/hunyuan/step_choice.py).

Measured (bench/results/fused_step/README.md): the first version was 10-15% slower than
today's step on an H100 (its attention merge ~20 us a layer); the merge and programmatic
dependent launch (FusedConfig.pdl) came after, not yet measured on a GPU.

Triton is imported lazily; with TRITON_INTERPRET=1 the kernels run on the CPU (float32 models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ocrq.models.hunyuan.attention import DEFAULT_CONFIG, FP8_CONFIG, PAD_KEYS

LOG2E = math.log2(math.e)
FP8_MAX = 448.0


@dataclass(frozen=True)
class FusedConfig:
    """Block shapes (the bench may try others)."""

    block_n: int = 16  # output columns a GEMV program covers (tl.dot needs >= 16)
    # inputs a norm + GEMV loop iteration reads; >= hidden: the whole row in one tile (ONE_K)
    block_k: int = 1024
    lm_block_n: int = 128  # the lm_head's columns a program
    split_k: int = 512  # inputs a split-K program covers in one tile (O and down projections)
    # keys an attention loop iteration reads; None: the running loop's split kernel's choice
    # for the pool's dtype (ocrq/models/hunyuan/attention.py: 64 for bf16, 128 for fp8)
    attn_block_n: int | None = None
    # rows x KV heads x key ranges: about this many programs a step (None: programs_per_sm a
    # streaming multiprocessor, as the loop's split kernel aims; v2 fixed 128, which left 8
    # rows of 4k keys at two ranges a head and 0.6-0.8x today's step on an H200)
    attn_programs: int | None = None
    programs_per_sm: int = 4
    max_splits: int = 16
    # Programmatic dependent launch (CUDA only): each kernel lets the next one start at once,
    # and the next loads its weights (which no kernel writes) before waiting for the last
    # kernel's results, so a weight read overlaps the tail of the kernel before it.
    pdl: bool = True
    num_warps: int = 4
    num_stages: int = 3


@dataclass
class FusedLayer:
    qkv: torch.Tensor  # (H*D + 2*KVH*D, hidden)
    o: torch.Tensor  # (hidden, H*D)
    gate_up: torch.Tensor  # (2*inter, hidden)
    down: torch.Tensor  # (hidden, inter)
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    eps: float
    qk_eps: float


@dataclass
class FusedWeights:
    """The text decoder's tensors, as the kernels read them (views of the model's own)."""

    embed: torch.Tensor
    layers: list[FusedLayer]
    norm: torch.Tensor
    norm_eps: float
    lm_head: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    @classmethod
    def from_text(cls, text: Any) -> FusedWeights:
        """From a TextModel (ocrq/models/hunyuan/text.py): its merged q/k/v and gate/up weights
        (made now if not yet; a layer that cannot merge gets a concatenated copy)."""
        import torch

        qkvs, gate_ups = text.merge()
        layers = []
        for li, layer in enumerate(text.layers):
            a, m = layer.self_attn, layer.mlp
            qkv = qkvs[li]
            if qkv is None:
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            gu = gate_ups[li]
            if gu is None:
                gu = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            layers.append(FusedLayer(
                qkv=qkv, o=a.o_proj.weight, gate_up=gu, down=m.down_proj.weight,
                in_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                q_norm=a.query_layernorm.weight, k_norm=a.key_layernorm.weight,
                eps=float(layer.input_layernorm.variance_epsilon),
                qk_eps=float(a.query_layernorm.variance_epsilon),
            ))
        return cls(embed=text.embed.weight, layers=layers, norm=text.norm.weight,
                   norm_eps=float(text.norm.variance_epsilon), lm_head=text.lm_head.weight,
                   heads=text.heads, kv_heads=text.kv_heads, head_dim=text.head_dim,
                   scale=text.scale)


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def norm_gemv_kernel(
        X, Tok, Emb, P, NW, W, Y, HOut,
        B, N, K, eps, s_x, s_e, s_p, s_w, s_y, s_h, gate_off,
        EMB: tl.constexpr, HAS_P: tl.constexpr, GATE: tl.constexpr, UPCAST: tl.constexpr,
        ONE_K: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if PDL:  # let the next kernel start its own weight loads now (FusedConfig.pdl)
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.arange(0, BP)
        r_ok = rows < B
        dtype = W.dtype.element_ty
        if EMB:  # the first layer: the residual stream is the token's embedding row
            tok = tl.load(Tok + rows, mask=r_ok, other=0).to(tl.int64)
            src = Emb + tok * s_e
        else:
            src = X + rows.to(tl.int64) * s_x
        offs_n = pid * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        acc = tl.zeros([BP, BN], tl.float32)
        acc_u = tl.zeros([BP, BN], tl.float32)
        w_rows = W + offs_n.to(tl.int64)[:, None] * s_w
        if ONE_K:  # the whole row in one tile: h read once, every weight load issued at once
            ks = tl.arange(0, BK)
            k_ok = ks < K
            ok = r_ok[:, None] & k_ok[None, :]
            wk = w_rows + ks[None, :]
            w = tl.load(wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if GATE:
                u = tl.load(wk + gate_off * s_w, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if PDL:  # the weights are loading; what the last kernel wrote is read from here on
                tl.extra.cuda.gdc_wait()
            h = tl.load(src[:, None] + ks[None, :], mask=ok, other=0.0)
            if HAS_P:
                p = tl.load(P + rows[:, None] * s_p + ks[None, :], mask=ok, other=0.0)
                h = (h.to(tl.float32) + p.to(dtype).to(tl.float32)).to(dtype)
            if pid == 0:
                tl.store(HOut + rows[:, None] * s_h + ks[None, :], h, mask=ok)
            hf = h.to(tl.float32)
            rs = tl.rsqrt(tl.sum(hf * hf, 1) / K + eps)
            y = (hf * rs[:, None]).to(dtype).to(tl.float32)
            nw = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = (nw[None, :] * y).to(dtype)
            if UPCAST:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if GATE:
                if UPCAST:
                    acc_u += tl.dot(x, tl.trans(u), input_precision="ieee")
                else:
                    acc_u += tl.dot(x, tl.trans(u))
        else:
            if PDL:
                tl.extra.cuda.gdc_wait()
            # pass 1: the residual (h + pending, rounded as transformers rounds), mean square
            ss = tl.zeros([BP], tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                ok = r_ok[:, None] & (ks[None, :] < K)
                h = tl.load(src[:, None] + ks[None, :], mask=ok, other=0.0)
                if HAS_P:
                    p = tl.load(P + rows[:, None] * s_p + ks[None, :], mask=ok, other=0.0)
                    h = (h.to(tl.float32) + p.to(dtype).to(tl.float32)).to(dtype)
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, 1)
                if pid == 0:
                    tl.store(HOut + rows[:, None] * s_h + ks[None, :], h, mask=ok)
            rs = tl.rsqrt(ss / K + eps)
            # pass 2: the normalised row (L1/L2-resident) against this program's weight columns
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                k_ok = ks < K
                ok = r_ok[:, None] & k_ok[None, :]
                h = tl.load(src[:, None] + ks[None, :], mask=ok, other=0.0)
                if HAS_P:
                    p = tl.load(P + rows[:, None] * s_p + ks[None, :], mask=ok, other=0.0)
                    h = (h.to(tl.float32) + p.to(dtype).to(tl.float32)).to(dtype)
                y = (h.to(tl.float32) * rs[:, None]).to(dtype).to(tl.float32)
                nw = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
                x = (nw[None, :] * y).to(dtype)
                wk = w_rows + ks[None, :]
                w = tl.load(wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
                if GATE:
                    u = tl.load(wk + gate_off * s_w, mask=n_ok[:, None] & k_ok[None, :],
                                other=0.0)
                    if UPCAST:
                        acc_u += tl.dot(x, tl.trans(u), input_precision="ieee")
                    else:
                        acc_u += tl.dot(x, tl.trans(u))
        if GATE:  # silu(gate) * up as kernels.silu_mul rounds it
            g = acc.to(dtype).to(tl.float32)
            act = tl.math.div_rn(g, 1.0 + tl.math.exp(-g)).to(dtype).to(tl.float32)
            out = act * acc_u.to(dtype).to(tl.float32)
        else:
            out = acc
        tl.store(Y + rows[:, None] * s_y + offs_n[None, :], out.to(Y.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])

    @triton.jit
    def gemv_splitk_kernel(
        X, W, Acc, B, N, K, s_x, s_w, s_a,
        UPCAST: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        sk = tl.program_id(1)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.arange(0, BP)
        r_ok = rows < B
        offs_n = pid * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        ks = sk * BK + tl.arange(0, BK)
        k_ok = ks < K
        w = tl.load(W + offs_n.to(tl.int64)[:, None] * s_w + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + rows[:, None] * s_x + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.zeros([BP, BN], tl.float32)
        if UPCAST:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        tl.atomic_add(Acc + rows[:, None] * s_a + offs_n[None, :], acc,
                      mask=r_ok[:, None] & n_ok[None, :])

    @triton.jit
    def attention_kernel(
        QKV, Cos, Sin, QW, KW, Kp, Vp, Start, End, Col, Out,
        PAcc, PM, PL, Cnt,
        s_q, s_c, s_kh, s_kl, s_vh, s_vl, s_vd, s_o, s_ab, s_ah, s_as, s_mb, s_mh,
        eps, qk_scale, H: tl.constexpr, KVH: tl.constexpr,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        S: tl.constexpr, SP: tl.constexpr, UPCAST: tl.constexpr, CAST_KV: tl.constexpr,
        SAT: tl.constexpr, FP8_MAX: tl.constexpr, PADDED: tl.constexpr, PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        dtype = QKV.dtype.element_ty
        offs_d = tl.arange(0, D)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        rot = (offs_d + D // 2) % D  # x rotated by half: -x[d + half] below half, x[d - half] above
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        cos = tl.load(Cos + b * s_c + offs_d)
        sin = tl.load(Sin + b * s_c + offs_d)
        row = QKV + b * s_q
        # the group's queries: RoPE (rounded), per-head RMSNorm, weight (rounded), as
        # kernels.rope_rms_norm
        qp = row + heads[:, None] * D
        qa = tl.load(qp + offs_d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        qb = tl.load(qp + rot[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        r = (qa * cos[None, :] + sign[None, :] * qb * sin[None, :]).to(dtype).to(tl.float32)
        rs = tl.rsqrt(tl.sum(r * r, 1) / D + eps)
        y = (r * rs[:, None]).to(dtype).to(tl.float32)
        q = (tl.load(QW + offs_d).to(tl.float32)[None, :] * y).to(dtype)
        # the new key, likewise, and its value
        kp = row + (H + kvh) * D
        ka = tl.load(kp + offs_d).to(tl.float32)
        kb = tl.load(kp + rot).to(tl.float32)
        rk = (ka * cos + sign * kb * sin).to(dtype).to(tl.float32)
        rsk = tl.rsqrt(tl.sum(rk * rk, 0) / D + eps)
        yk = (rk * rsk).to(dtype).to(tl.float32)
        kn = (tl.load(KW + offs_d).to(tl.float32) * yk).to(dtype)
        vn = tl.load(row + (H + KVH + kvh) * D + offs_d)
        start = tl.load(Start + b)
        end = tl.load(End + b)
        kvh64 = kvh.to(tl.int64)
        k_base = Kp + kvh64 * s_kh
        v_base = Vp + kvh64 * s_vh
        if CAST_KV:  # an fp8 pool: what is stored, saturated; attended as stored
            kst = tl.minimum(tl.maximum(kn.to(tl.float32), -FP8_MAX), FP8_MAX).to(
                Kp.dtype.element_ty)
            vst = tl.minimum(tl.maximum(vn.to(tl.float32), -FP8_MAX), FP8_MAX).to(
                Vp.dtype.element_ty)
            kn_f = kst.to(tl.float32)
            vn_f = vst.to(tl.float32)
        else:
            kst = kn
            vst = vn
            kn_f = kn.to(tl.float32)
            vn_f = vn.to(tl.float32)
        if s == 0:
            col = tl.load(Col + b).to(tl.int64)
            tl.store(k_base + col * s_kl + offs_d, kst)
            tl.store(v_base + col * s_vl + offs_d * s_vd, vst)
        # range s of the old keys [start, end - 1); range 0 also holds the new key
        n_old = end - 1 - start
        per = tl.cdiv(tl.cdiv(n_old, S), BLOCK_N) * BLOCK_N
        lo = start + s * per
        hi = tl.minimum(end - 1, lo + per)
        if UPCAST:
            q_dot = q.to(tl.float32)
        elif CAST_KV:
            q_dot = q.to(tl.float16)
        else:
            q_dot = q
        s_new = tl.sum(q.to(tl.float32) * kn_f[None, :], 1) * qk_scale
        is0 = s == 0
        m_i = tl.where(is0, s_new, float("-inf"))
        l_i = tl.where(is0, 1.0, 0.0) + tl.zeros([GP], tl.float32)
        acc = tl.where(is0, 1.0, 0.0) * vn_f[None, :] + tl.zeros([GP, D], tl.float32)
        first = lo
        stop = hi
        if PADDED:  # whole blocks from a 16-key boundary; keys outside [lo, hi) masked in scores
            first = tl.multiple_of((lo // 16) * 16, 16)
            # an empty range stays empty (a block of masked keys only would make exp2(-inf -
            # -inf) of a range with no new key NaN)
            stop = tl.where(lo < hi, hi, first)
        for n0 in range(first, stop, BLOCK_N):
            if PADDED:
                n0 = tl.multiple_of(n0, 16)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k_at = k_base + offs_n[:, None] * s_kl + offs_d[None, :]
            v_at = v_base + offs_n[:, None] * s_vl + offs_d[None, :] * s_vd
            if PADDED:  # finite past the end (zeroed, saturated), so p = 0 keeps them out
                n_ok = (offs_n >= lo) & (offs_n < hi)
                k = tl.load(k_at)
                v = tl.load(v_at)
            else:
                n_ok = offs_n < hi
                k = tl.load(k_at, mask=n_ok[:, None], other=0.0)
                v = tl.load(v_at, mask=n_ok[:, None], other=0.0)
            if UPCAST:
                sc = tl.dot(q_dot, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif CAST_KV:
                sc = tl.dot(q_dot, tl.trans(k.to(tl.float16)))
            else:
                sc = tl.dot(q_dot, tl.trans(k))
            sc = tl.where(n_ok[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if UPCAST:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif CAST_KV:
                pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o_ptr = Out + b * s_o + heads[:, None] * D + offs_d[None, :]
        if S == 1:
            tl.store(o_ptr, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=g_ok[:, None])
        else:
            pa = PAcc + b * s_ab + heads[:, None] * s_ah + offs_d[None, :]
            pm = PM + b * s_mb + heads * s_mh
            tl.store(pa + s * s_as, acc, mask=g_ok[:, None])
            tl.store(pm + s, m_i, mask=g_ok)
            tl.store(PL + b * s_mb + heads * s_mh + s, l_i, mask=g_ok)
            # the last range of (row, KV head) to finish merges them all: no merge kernel
            tl.debug_barrier()
            done = tl.atomic_add(Cnt + b * KVH + kvh, 1, sem="acq_rel", scope="gpu")
            if done == S - 1:  # every range of each head in one load: no chain of loads
                offs_s = tl.arange(0, SP)
                s_ok = offs_s < S
                for g in tl.static_range(G):
                    hd = kvh * G + g
                    m = tl.load(PM + b * s_mb + hd * s_mh + offs_s, mask=s_ok,
                                other=float("-inf"), cache_modifier=".cg")
                    lsum = tl.load(PL + b * s_mb + hd * s_mh + offs_s, mask=s_ok, other=0.0,
                                   cache_modifier=".cg")
                    part = tl.load(PAcc + b * s_ab + hd * s_ah + offs_s[:, None] * s_as
                                   + offs_d[None, :], mask=s_ok[:, None], other=0.0,
                                   cache_modifier=".cg")
                    wgt = tl.where(s_ok, tl.exp2(m - tl.max(m, 0)), 0.0)
                    merged = tl.sum(part * wgt[:, None], 0) / tl.sum(wgt * lsum, 0)
                    tl.store(Out + b * s_o + hd * D + offs_d, merged.to(Out.dtype.element_ty))
                tl.store(Cnt + b * KVH + kvh, 0)

    return norm_gemv_kernel, gemv_splitk_kernel, attention_kernel


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class FusedStep:
    """The fused step for one batch size: scratch buffers sized once, so it can be graphed."""

    def __init__(self, weights: FusedWeights, batch: int, device: Any,
                 config: FusedConfig | None = None, sm_count: int | None = None,
                 padded: bool = False) -> None:
        import torch

        c = config or FusedConfig()
        w = weights
        if batch > 16:
            raise ValueError(f"the fused step serves up to 16 rows, not {batch}")
        if w.head_dim != _pow2(w.head_dim) or w.head_dim < 16:
            raise ValueError(f"head_dim {w.head_dim} must be a power of two >= 16")
        self.w, self.c, self.batch = w, c, batch
        self.pdl = c.pdl and torch.device(device).type == "cuda"
        self.launch = {"launch_pdl": True} if self.pdl else {}
        if sm_count is None:
            sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                        if torch.device(device).type == "cuda" else 4)
        programs = c.attn_programs or c.programs_per_sm * sm_count
        self.splits = max(1, min(c.max_splits, -(-programs // (batch * w.kv_heads))))
        # `padded`: the pool keeps PAD_KEYS readable keys past every row's last, as the running
        # loop's does, so attention blocks start at 16-key boundaries and load unmasked (vector
        # loads of a transposed fp8 pool's values; ocrq/models/hunyuan/attention.py)
        self.padded = padded
        hidden = w.embed.shape[1]
        self.hidden = hidden
        self.inter = w.layers[0].down.shape[1]
        dt, f32 = w.embed.dtype, torch.float32
        n_layers = len(w.layers)
        self.h = [torch.empty(batch, hidden, dtype=dt, device=device) for _ in range(2)]
        self.qkv = torch.empty(batch, w.layers[0].qkv.shape[0], dtype=dt, device=device)
        self.o = torch.empty(batch, w.heads * w.head_dim, dtype=dt, device=device)
        self.act = torch.empty(batch, self.inter, dtype=dt, device=device)
        self.sums = torch.zeros(2, n_layers, batch, hidden, dtype=f32, device=device)
        self.pacc = torch.empty(batch, w.heads, self.splits, w.head_dim, dtype=f32,
                                device=device)
        self.pm = torch.empty(batch, w.heads, self.splits, dtype=f32, device=device)
        self.pl = torch.empty(batch, w.heads, self.splits, dtype=f32, device=device)
        self.count = torch.zeros(batch, w.kv_heads, dtype=torch.int32, device=device)
        self.logits = torch.empty(batch, w.lm_head.shape[0], dtype=dt, device=device)

    def kernels_per_step(self) -> int:
        return 5 * len(self.w.layers) + 2  # + the zeroing of the sums + the lm_head

    def __call__(self, tok: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 col: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Logits (B, V) for one token per row; writes each layer's new key and value at
        column `col` (B,) of its pool (1, KVH, width, D); row b attends [start_b, end_b), the
        last of which is col_b. cos, sin (B, D) float32 (TextModel.rope, rounded)."""
        import torch

        norm_gemv, splitk, attention = _kernels()
        w, c, B = self.w, self.c, self.batch
        dt = w.embed.dtype
        up = dt == torch.float32
        BP = 16
        hd, H, KVH = w.head_dim, w.heads, w.kv_heads
        self.sums.zero_()
        hA, hB = self.h
        one_k = c.block_k >= self.hidden  # the norm's row in one tile
        bk = _pow2(self.hidden) if one_k else c.block_k
        col = col.contiguous()
        attn_block = c.attn_block_n or (
            FP8_CONFIG.block_n if keys[0].dtype != dt else DEFAULT_CONFIG.block_n)
        if self.padded and attn_block > PAD_KEYS:
            raise ValueError(f"attn_block_n {attn_block} reads past the pool's {PAD_KEYS} keys")
        for li, lay in enumerate(w.layers):
            first = li == 0
            pend = self.sums[1, li - 1] if not first else self.sums[1, 0]
            n_qkv = lay.qkv.shape[0]
            norm_gemv[(triton_cdiv(n_qkv, c.block_n),)](
                hA, tok, w.embed, pend, lay.in_norm, lay.qkv, self.qkv, hB,
                B, n_qkv, self.hidden, lay.eps, hA.stride(0), w.embed.stride(0),
                pend.stride(0), lay.qkv.stride(0), self.qkv.stride(0), hB.stride(0), 0,
                EMB=first, HAS_P=not first, GATE=False, UPCAST=up, BP=BP, BN=c.block_n,
                BK=bk, ONE_K=one_k, PDL=self.pdl, num_warps=c.num_warps,
                num_stages=c.num_stages, **self.launch,
            )
            kc, vc = keys[li], values[li]
            attention[(B, KVH, self.splits)](
                self.qkv, cos, sin, lay.q_norm, lay.k_norm, kc, vc, start, end, col, self.o,
                self.pacc, self.pm, self.pl, self.count,
                self.qkv.stride(0), cos.stride(0), kc.stride(1), kc.stride(2), vc.stride(1),
                vc.stride(2), vc.stride(3), self.o.stride(0), self.pacc.stride(0),
                self.pacc.stride(1), self.pacc.stride(2), self.pm.stride(0), self.pm.stride(1),
                lay.qk_eps, w.scale * LOG2E, H=H, KVH=KVH, G=H // KVH,
                GP=max(16, _pow2(H // KVH)), D=hd, BLOCK_N=attn_block, S=self.splits,
                SP=_pow2(self.splits), UPCAST=up, CAST_KV=kc.dtype != dt, SAT=kc.dtype != dt,
                FP8_MAX=FP8_MAX, PADDED=self.padded, PDL=self.pdl, num_warps=c.num_warps,
                **self.launch,
            )
            o_sum = self.sums[0, li]
            self._splitk(splitk, self.o, lay.o, o_sum, up)
            n_gate = self.inter
            norm_gemv[(triton_cdiv(n_gate, c.block_n),)](
                hB, tok, w.embed, o_sum, lay.post_norm, lay.gate_up, self.act, hA,
                B, n_gate, self.hidden, lay.eps, hB.stride(0), w.embed.stride(0),
                o_sum.stride(0), lay.gate_up.stride(0), self.act.stride(0), hA.stride(0),
                n_gate, EMB=False, HAS_P=True, GATE=True, UPCAST=up, BP=BP, BN=c.block_n,
                BK=bk, ONE_K=one_k, PDL=self.pdl, num_warps=c.num_warps,
                num_stages=c.num_stages, **self.launch,
            )
            self._splitk(splitk, self.act, lay.down, self.sums[1, li], up)
        last = self.sums[1, len(w.layers) - 1]
        vocab = w.lm_head.shape[0]
        norm_gemv[(triton_cdiv(vocab, c.lm_block_n),)](
            hA, tok, w.embed, last, w.norm, w.lm_head, self.logits, hB,
            B, vocab, self.hidden, w.norm_eps, hA.stride(0), w.embed.stride(0), last.stride(0),
            w.lm_head.stride(0), self.logits.stride(0), hB.stride(0), 0,
            EMB=False, HAS_P=True, GATE=False, UPCAST=up, BP=BP, BN=c.lm_block_n,
            BK=bk, ONE_K=one_k, PDL=self.pdl, num_warps=c.num_warps,
                num_stages=c.num_stages, **self.launch,
        )
        return self.logits

    def _splitk(self, kernel: Any, x: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor,
                up: bool) -> None:
        c = self.c
        n, k = weight.shape
        bk = _pow2(c.split_k)
        kernel[(triton_cdiv(n, c.block_n), triton_cdiv(k, bk))](
            x, weight, acc, self.batch, n, k, x.stride(0), weight.stride(0), acc.stride(0),
            UPCAST=up, BP=16, BN=c.block_n, BK=bk, PDL=self.pdl,
            num_warps=c.num_warps, num_stages=c.num_stages, **self.launch,
        )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fused_decode_step(text: Any, step: FusedStep, tok: torch.Tensor, pos: torch.Tensor,
                      col: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                      keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Logits (B, V) of one decode step for the few rows `step` was sized for: tokens `tok`
    (B,) at RoPE positions `pos` (axes, B) of the TextModel `text` (its rope tables, rounded as
    transformers rounds them), keys and values written at `col` (B,) of each layer's pool and
    [start, end) attended; the same arguments as `TextModel.step(..., pooled=True)` plus the
    visible ranges the running loop keeps."""
    cos, sin = text.rope(pos)
    return step(tok, cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous(), col,
                start, end, keys, values)
