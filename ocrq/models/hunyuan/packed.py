"""The running loop's prefill with the rows packed end to end: no padding, one causal varlen
attention per layer.

Why: a prefill pass costs the host about as much to launch as the GPU takes to run it (118 ms
against 107 ms a pass of the service's mix on an H200; most of the GPU's idle time sat in gaps
over 1 ms while the loop thread launched a pass: bench/results/service_gpu/service_gpu_reading.md,
"Where the steady GPU waits"). That cost is paid per pass, whatever it holds, so fuller passes would
spread it over more images, but the padded prefill pays rows x the longest prompt: 12,288-token
passes cut the passes by 2.3x and gained nothing (runs 6-7). Packed, a pass holds what its
rows hold, so `OCRQ_PREFILL_CHUNK_TOKENS` can grow with it. Measured on the H200 (runs 14-17):
the prefill's GPU time fell by 39% on the service's mix, and with 16,384-token passes the GPU
was busy 98% of the service's steady state. The default since; `OCRQ_PREFILL_PACKED=false`
pads instead.

Every layer is the padded prefill's (`text_layers` in ocrq/models/hunyuan/prefill.py: the same
modules and Triton norm/RoPE kernels) over the flat (tokens, hidden) stream; only the attention
differs: each row attends causally over its own tokens, by cumulative lengths. On CUDA that
is the flash kernel SDPA itself uses for variable lengths
(`torch.ops.aten._flash_attention_forward`); elsewhere each row through SDPA (tests). The tests
hold it to the padded prefill's tokens and logits.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.inputs import device_pixels, image_token_at
from ocrq.models.hunyuan.prefill import place_images, text_layers
from ocrq.models.hunyuan.readback import to_device

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from ocrq.models.hunyuan.inputs import EncodedImage
    from ocrq.models.hunyuan.text import TextModel
    from ocrq.models.hunyuan.vision_attention import VarlenKernel


@dataclass
class PackedBatch:
    """Rows end to end on the device, and what the host knows of them (no sync needed)."""

    ids: torch.Tensor  # (tokens,) long
    positions: torch.Tensor  # (axes, tokens) multimodal RoPE positions
    pixels: torch.Tensor  # (patches, C * p * p) every row's, in order
    grid: torch.Tensor  # (images, 3) on the CPU
    image_at: torch.Tensor  # (image tokens,) long: where image features go
    bounds: torch.Tensor  # (rows + 1,) int32: cumulative row lengths, on the device
    edges: list[int]  # the same on the host (the attention without the flash kernel)
    last: torch.Tensor  # (rows,) long: each row's last token
    row_of: torch.Tensor  # (tokens,) long: the row each token belongs to

    @property
    def longest(self) -> int:
        """Tokens of the longest row."""
        return max(hi - lo for lo, hi in itertools.pairwise(self.edges))


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
    long = torch.long
    positions = torch.cat([r.positions for r in rows], dim=1)  # type: ignore[misc]
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    return PackedBatch(
        ids=to_device(torch.cat([r.input_ids for r in rows]), long, device),
        positions=to_device(positions.contiguous(), long, device),
        pixels=device_pixels(rows, device, dtype),
        grid=torch.cat([r.image_grid_thw for r in rows], dim=0),
        image_at=to_device(image_token_at(rows, image_token_id, offsets), long, device),
        bounds=to_device(offsets, torch.int32, device),
        edges=offsets,
        last=to_device([o - 1 for o in offsets[1:]], long, device),
        row_of=to_device(row_of, long, device),
    )


def prefill_packed(text: TextModel, batch: PackedBatch, fused: bool
                   ) -> tuple[list[Any], torch.Tensor]:
    """Per-layer (keys, values) of every packed token as (kv_heads, tokens, D), and the logits
    (rows, V) of each row's last token. `fused` as in `text_layers`."""
    h = text.embed(batch.ids)  # (n, hidden)
    place_images(text, h, batch.pixels, batch.grid, batch.image_at)
    n = h.shape[0]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any]:
        o = causal_varlen(q, k, v, batch, text.scale, text.causal_kernel)
        return o.reshape(n, text.heads * text.head_dim), (k.transpose(0, 1), v.transpose(0, 1))

    return text_layers(text, h, batch.positions, attend, batch.last, fused=fused)


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch,
                  scale: float, kernel: VarlenKernel | None = None) -> torch.Tensor:
    """(tokens, heads, D) causal attention of each row over its own tokens: through `kernel`
    where given (FlashAttention-4, `Settings.prefill_attention`; it groups the query heads over
    the key/value heads itself), else with the key/value heads repeated to the query heads first
    (a prefill's keys are small beside its activations), as transformers' sdpa integration does
    with a mask."""
    import torch
    import torch.nn.functional as F

    if kernel is not None:
        return kernel(q, k, v, batch.bounds, batch.longest, scale)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if flash_varlen_ok(q):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, batch.bounds, batch.bounds, batch.longest, batch.longest, 0.0, True, False,
            scale=scale,
        )[0]
    out = torch.empty_like(q)
    for lo, hi in itertools.pairwise(batch.edges):  # host bounds: no sync on a GPU either
        out[lo:hi] = F.scaled_dot_product_attention(
            *(t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=scale
        )[0].transpose(0, 1)
    return out


def flash_varlen_ok(q: torch.Tensor) -> bool:
    """Whether torch's flash kernel takes these queries: CUDA (not ROCm), fp16/bf16, an Ampere
    or newer GPU, a head size of at most 256 in multiples of 8. Elsewhere (a T4, a V100, the
    CPU) each row goes through SDPA: slower, the same result."""
    import torch

    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or torch.version.hip:
        return False
    dim = q.shape[-1]
    return _capability(q.device.index or 0)[0] >= 8 and dim % 8 == 0 and dim <= 256


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)
