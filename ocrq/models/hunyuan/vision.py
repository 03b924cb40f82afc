"""The vision tower's attention over the images of one pass: as few calls as the kernels allow.

Why: transformers' HunYuanVL vision attention, unless a flash-attention package is installed,
splits the packed patches image by image and calls SDPA once per image in each of 27 layers.
Runs of equal-sized images already shared one batched SDPA call (ocrq/models/hunyuan/patches.py),
but the service's mix is mostly scene photos of all sizes: a prefill pass carried a score of them
and launched hundreds of small attention calls from Python, and the GPU waited for the host
inside those passes (NVML found a kernel running 80-85% of the time while the loop's CUDA events
covered 98.5% of the wall; bench/results/service_gpu_reading.md, runs 8-11).

The plan (`plan_groups`, pure):

* an image of at least `PACK_BELOW` patches gets an SDPA call of its own: for one long sequence
  SDPA picks cuDNN's fused kernel, which beat the flash varlen kernel on one A4 page on the H200
  (bench/results/vision_attention_h200.md);
* a run of equal-sized shorter images: one SDPA call with the images as its batch dimension;
* a run of shorter images of different sizes, where the device has the flash varlen kernel:
  one `torch.ops.aten._flash_attention_forward` call with cumulative lengths (the kernel SDPA's
  flash backend itself uses for nested tensors), each image attending over its own patches;
  elsewhere (the CPU), its equal-sized sub-runs as above.

Every call computes each image's attention over its own patches only, as the library's loop does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

PACK_BELOW = 4096  # patches: longer images keep an SDPA call of their own

Kind = Literal["sdpa", "varlen"]


@dataclass(frozen=True)
class Group:
    """Consecutive images whose attention is one call: patches [lo, hi) of the pass. "sdpa"
    groups hold equal-sized images (a batch dimension); "varlen" groups any sizes."""

    lo: int
    hi: int
    lengths: tuple[int, ...]
    kind: Kind


def plan_groups(lengths: list[int], *, varlen: bool, pack_below: int = PACK_BELOW) -> list[Group]:
    """The attention calls for images of these patch counts, in order (see the module doc)."""
    groups: list[Group] = []
    offset = 0

    def add(run: list[int], kind: Kind) -> None:
        nonlocal offset
        size = sum(run)
        groups.append(Group(offset, offset + size, tuple(run), kind))
        offset += size

    def flush(run: list[int]) -> None:
        if varlen and len(set(run)) > 1:
            add(run, "varlen")
            return
        i = 0
        while i < len(run):  # equal-sized sub-runs
            j = i
            while j < len(run) and run[j] == run[i]:
                j += 1
            add(run[i:j], "sdpa")
            i = j

    run: list[int] = []
    for n in lengths:
        if n >= pack_below:
            flush(run)
            run = []
            add([n], "sdpa")
        else:
            run.append(n)
    flush(run)
    return groups


def varlen_available(device: Any, dtype: Any, head_dim: int) -> bool:
    """Whether the flash varlen kernel runs here: CUDA, Ampere or newer, half precision, a head
    size it was built for."""
    import torch

    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[Group], scale: float
) -> torch.Tensor:
    """Packed (patches, heads, dim) queries, keys and values of a pass's images; the attention
    output in the same layout, each image over its own patches."""
    import torch
    import torch.nn.functional as F

    heads, dim = q.shape[1], q.shape[2]
    outputs = []
    for group in groups:
        span = slice(group.lo, group.hi)
        if group.kind == "varlen":
            bounds = _bounds(group.lengths, str(q.device))
            outputs.append(_varlen(q[span], k[span], v[span], bounds, max(group.lengths), scale))
            continue
        count, n = len(group.lengths), group.lengths[0]

        def images(x: torch.Tensor, span: slice = span, count: int = count, n: int = n
                   ) -> torch.Tensor:
            return x[span].view(count, n, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            images(q), images(k), images(v), dropout_p=0.0, scale=scale, is_causal=False
        )
        outputs.append(out.transpose(1, 2).reshape(count * n, heads, dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


@lru_cache(maxsize=256)
def _bounds(lengths: tuple[int, ...], device: str) -> torch.Tensor:
    """Cumulative lengths (int32) on the device, made once per run of sizes: every layer of the
    pass, and later passes of the same images, reuse them. Copied without a sync: the running
    loop queues its prefill behind decode steps it must not wait for."""
    import torch

    from ocrq.models.hunyuan.readback import to_device

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return to_device(bounds, torch.int32, device)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
            longest: int, scale: float) -> torch.Tensor:
    """One call over packed images of any sizes. On CUDA the flash kernel; on the CPU (tests
    force a "varlen" plan there) the same bounds read back and each image through SDPA, so a
    wrong bound fails there too."""
    import torch
    import torch.nn.functional as F

    if q.device.type == "cuda":
        return torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, bounds, longest, longest, 0.0, False, False, scale=scale
        )[0]
    edges = bounds.tolist()
    parts = [
        F.scaled_dot_product_attention(
            *(t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)), scale=scale
        )[0].transpose(0, 1)
        for lo, hi in itertools.pairwise(edges)
    ]
    return torch.cat(parts, dim=0)
