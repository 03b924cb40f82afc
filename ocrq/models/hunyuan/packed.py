"""The running loop's prefill with the rows packed end to end: no padding, one causal varlen
attention per layer.

Why: a prefill pass costs the host about as much to launch as the GPU takes to run it (118 ms
against 107 ms a pass of the service's mix on an H200; most of the GPU's idle time sat in gaps
over 1 ms while the loop thread launched a pass: bench/results/service_gpu_reading.md, "Where
the steady GPU waits"). That cost is paid per pass, whatever it holds, so fuller passes would
spread it over more images, but the padded prefill pays rows x the longest prompt: 12,288-token
passes cut the passes by 2.3x and gained nothing (runs 6-7). Packed, a pass holds what its
rows hold, so `OCRQ_PREFILL_CHUNK_TOKENS` can grow with it (`OCRQ_PREFILL_PACKED`).

Every layer is the fused prefill's (ocrq/models/hunyuan/prefill.py: the same modules and Triton
norm/RoPE kernels) over the flat (tokens, hidden) stream; only the attention differs: each row
attends causally over its own tokens, by cumulative lengths. On CUDA that is the flash kernel
SDPA itself uses for variable lengths (`torch.ops.aten._flash_attention_forward`); elsewhere
each row through SDPA (tests). The tests hold it to the padded prefill's tokens and logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.kernels import add_rms_norm, rope_rms_norm
from ocrq.models.hunyuan.readback import to_device

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from ocrq.models.hunyuan.inputs import EncodedImage
    from ocrq.models.hunyuan.text import TextModel


@dataclass
class PackedBatch:
    """Rows end to end on the device, and what the host knows of them (no sync needed)."""

    ids: torch.Tensor  # (tokens,) long
    positions: torch.Tensor  # (axes, tokens) multimodal RoPE positions
    pixels: torch.Tensor | None  # (patches, C * p * p) every row's, in order
    grid: torch.Tensor  # (images, 3) on the CPU
    image_at: torch.Tensor  # (image tokens,) long: where image features go
    bounds: torch.Tensor  # (rows + 1,) int32: cumulative row lengths, on the device
    last: torch.Tensor  # (rows,) long: each row's last token
    row_of: torch.Tensor  # (tokens,) long: the row each token belongs to
    lengths: list[int]
    longest: int


def pack(rows: Sequence[EncodedImage], image_token_id: int, device: Any, dtype: Any
         ) -> PackedBatch:
    """The rows' inputs end to end; every copy without a sync (pinned memory)."""
    import torch

    if any(r.positions is None for r in rows):
        raise ValueError("packed rows need their RoPE positions (the engine's preprocessing)")
    lengths = [int(r.input_ids.shape[0]) for r in rows]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids = torch.cat([r.input_ids for r in rows])
    positions = torch.cat([r.positions for r in rows], dim=1)  # type: ignore[misc]
    image_at = torch.cat([
        (r.input_ids == image_token_id).nonzero()[:, 0] + offset
        for r, offset in zip(rows, offsets, strict=False)
    ])
    long = torch.long
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    total = sum(int(r.pixel_values.shape[0]) for r in rows)
    pixels = None
    if total:
        pixels = torch.empty((total, rows[0].pixel_values.shape[1]), dtype=dtype, device=device)
        at = 0
        for r in rows:
            n = int(r.pixel_values.shape[0])
            pixels[at : at + n].copy_(r.pixel_values, non_blocking=True)
            at += n
    return PackedBatch(
        ids=to_device(ids, long, device),
        positions=to_device(positions.contiguous(), long, device),
        pixels=pixels,
        grid=torch.cat([r.image_grid_thw for r in rows], dim=0),
        image_at=to_device(image_at, long, device),
        bounds=to_device(offsets, torch.int32, device),
        last=to_device([o - 1 for o in offsets[1:]], long, device),
        row_of=to_device(row_of, long, device),
        lengths=lengths,
        longest=max(lengths),
    )


def prefill_packed(text: TextModel, batch: PackedBatch, fused: bool
                   ) -> tuple[list[Any], torch.Tensor]:
    """Per-layer (keys, values) of every packed token as (kv_heads, tokens, D), and the logits
    (rows, V) of each row's last token. `fused`: the norms and RoPE as the Triton kernels of
    the fused prefill, else as the model's modules with transformers' arithmetic (the decode
    step's `TextModel._layers`; the CPU)."""
    import torch

    from ocrq.models.hunyuan.text import rotate

    inner = text.model.model
    h = text.embed(batch.ids)  # (n, hidden)
    if batch.pixels is not None:
        feats = inner.get_image_features(batch.pixels, batch.grid, return_dict=True).pooler_output
        if isinstance(feats, (list, tuple)):
            feats = torch.cat(list(feats), dim=0)
        h.index_copy_(0, batch.image_at, feats.reshape(-1, h.shape[-1]).to(h.dtype))
        del feats
    n = h.shape[0]
    cos, sin = text.rope(batch.positions)  # (n, 1, D)
    if fused:
        cos, sin = cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous()
    else:
        cos, sin = cos.float(), sin.float()
    prompt_kv: list[Any] = []
    pending: torch.Tensor | None = None
    last = batch.last
    for layer in text.layers:
        attn = layer.self_attn
        qn, kn = attn.query_layernorm, attn.key_layernorm
        if fused:
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, pending, norm.weight, norm.variance_epsilon)
        else:
            x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(n, text.heads, text.head_dim)
        k = attn.k_proj(x).view(n, text.kv_heads, text.head_dim)
        v = attn.v_proj(x).view(n, text.kv_heads, text.head_dim)
        if fused:
            q = rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon)
            k = rope_rms_norm(k, cos, sin, kn.weight, kn.variance_epsilon)
        else:
            q, k = qn(rotate(q, cos, sin)), kn(rotate(k, cos, sin))
        o = causal_varlen(q, k, v, batch, text.scale)
        prompt_kv.append((k.transpose(0, 1), v.transpose(0, 1)))  # (kv_heads, n, D) views
        o = attn.o_proj(o.reshape(n, text.heads * text.head_dim))
        post = layer.post_attention_layernorm
        if fused:
            h, x = add_rms_norm(h, o, post.weight, post.variance_epsilon)
            pending = layer.mlp(x)
        else:
            h = h + o
            h = h + layer.mlp(post(h))
    if fused:
        assert pending is not None
        _, x = add_rms_norm(h[last], pending[last], text.norm.weight,
                            text.norm.variance_epsilon)
    else:
        x = text.norm(h[last])
    return prompt_kv, text.lm_head(x)


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch,
                  scale: float) -> torch.Tensor:
    """(tokens, heads, D) causal attention of each row over its own tokens. Key/value heads are
    repeated to the query heads first (a prefill's keys are small beside its activations), as
    transformers' sdpa integration does with a mask."""
    import torch
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, batch.bounds, batch.bounds, batch.longest, batch.longest, 0.0, True, False,
            scale=scale,
        )[0]
    out = torch.empty_like(q)
    edges = batch.bounds.tolist()  # the device's bounds, as the kernel reads them (no GPU here)
    for lo, hi in itertools.pairwise(edges):
        out[lo:hi] = F.scaled_dot_product_attention(
            *(t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=scale
        )[0].transpose(0, 1)
    return out
