"""Which kernel runs the vision tower's attention (and the packed text prefill's), and the
one-call varlen path over a pass.

Why: 83% of an A4 page's prefill is the vision tower, and its attention runs on cuDNN through
SDPA, one call per run of equal-sized images (ocrq/models/hunyuan/patches.py). FlashAttention-4
(the `flash-attn-4` package: CuTe DSL kernels compiled at first use) has a Hopper forward for
head size 72 that measured 484 TFLOP/s on one A4 page on the H200 against cuDNN's 353, and a
varlen form that takes every image of a pass in one call per layer whatever their sizes
(issue 29). It is optional: a separate install (`ocrq[fa4]`, docs/engines.md says why), NVIDIA
only, SM80/SM90/SM100 only.

`Settings.vision_attention`:

* "auto": FlashAttention-4 where `choose` finds it usable, else today's SDPA path;
* "fa4": FlashAttention-4, and loading fails with the reason where it is not usable;
* "sdpa": today's path (one SDPA call per run of equal-sized images).

`Settings.prefill_attention` takes the same three values for the running loop's packed text
prefill (ocrq/models/hunyuan/packed.py): `fa4_kernel(causal=True)` is its kernel, which takes
the text decoder's 8 key/value heads as they are (1.30x torch's flash path on 6 A4 pages on the
H200, bench/results/prefill_fa4/README.md).

`varlen_forward` is the attention forward the "fa4" choice installs on each vision layer. The
kernel is a parameter so that the packing around it (cumulative lengths on the device, the
longest image, the (patches, heads, dim) layout) is tested on a CPU with a torch reference in
the kernel's place (`reference_varlen`).
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

Kernel = Literal["fa4", "sdpa"]
# Compute capability majors FlashAttention-4's forward is built for (Ampere, Hopper, Blackwell).
FA4_MAJORS = (8, 9, 10)


class VarlenKernel(Protocol):
    """Attention over packed sequences: q, k, v (total, heads, dim); int32 cumulative lengths
    on q's device; the longest sequence; the softmax scale. Returns (total, heads, dim)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor: ...


def fa4_unusable(device: Any, dtype: Any, head_dim: int) -> str | None:
    """Why FlashAttention-4 cannot run the vision tower here, or None where it can."""
    import torch

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return f"it needs an NVIDIA GPU (device {device})"
    if torch.version.hip is not None:
        return "it needs CUDA, not ROCm"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_MAJORS:
        return f"it is built for SM80/SM90/SM100 GPUs, this one is SM{major}{minor}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it runs in float16 or bfloat16, the model is {dtype}"
    limit = 256 if major == 9 else 128
    if head_dim % 8 or not 8 <= head_dim <= limit:
        return f"head size {head_dim} is not one its SM{major}x forward supports"
    try:
        fa4_kernel()
    except ImportError as exc:
        return f"the flash-attn-4 package is not importable ({exc}); pip install 'ocrq[fa4]'"
    return None


def choose(setting: str, device: Any, dtype: Any, head_dim: int,
           name: str = "vision_attention") -> Kernel:
    """The kernel for `Settings.vision_attention` (or the setting `name`, with the same three
    values: `Settings.prefill_attention`) on this device (see the module doc)."""
    if setting == "sdpa":
        return "sdpa"
    if setting not in ("auto", "fa4"):
        raise ValueError(f"{name} must be auto, fa4 or sdpa, not {setting!r}")
    reason = fa4_unusable(device, dtype, head_dim)
    if reason is None:
        return "fa4"
    if setting == "fa4":
        raise RuntimeError(f"{name}=fa4, but FlashAttention-4 cannot run: {reason}")
    return "sdpa"


@lru_cache(maxsize=2)
def fa4_kernel(causal: bool = False) -> VarlenKernel:
    """FlashAttention-4's varlen forward as a `VarlenKernel` (imported once: the import pulls in
    the CuTe DSL compiler): bidirectional for the vision tower, `causal` for the running loop's
    packed text prefill (ocrq/models/hunyuan/packed.py), whose keys and values keep their own
    (fewer) heads: the kernel groups query heads over them, where torch's flash path needs them
    repeated first. Raises ImportError where the package is missing."""
    from flash_attn.cute import flash_attn_varlen_func

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               max_seqlen: int, scale: float) -> torch.Tensor:
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale, causal=causal,
        )
        return out[0] if isinstance(out, tuple) else out

    return kernel


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, causal: bool = False) -> torch.Tensor:
    """A `VarlenKernel` in plain torch: each sequence through SDPA over its own rows (causal
    where asked, with fewer key/value heads than query heads grouped as FlashAttention-4 groups
    them). It reads the cumulative lengths it is given, so a wrong bound or length fails
    against it too."""
    import torch
    import torch.nn.functional as F

    edges = cu_seqlens.tolist()
    if max(b - a for a, b in itertools.pairwise(edges)) > max_seqlen:
        raise ValueError("a sequence is longer than max_seqlen")
    parts = [
        F.scaled_dot_product_attention(
            *(t[lo:hi].transpose(0, 1)[None] for t in (q, k, v)), scale=scale, is_causal=causal,
            enable_gqa=k.shape[1] != q.shape[1],
        )[0].transpose(0, 1)
        for lo, hi in itertools.pairwise(edges)
    ]
    return torch.cat(parts, dim=0)


def reference_causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
                            ) -> torch.Tensor:
    """`reference_varlen`, causal: `fa4_kernel(causal=True)`'s stand-in where FA4 cannot run."""
    return reference_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal=True)


@lru_cache(maxsize=256)
def device_bounds(edges: tuple[int, ...], device: str) -> torch.Tensor:
    """Cumulative lengths (int32) on the device, made once per set of sizes: all 27 layers of a
    pass, and later passes of the same sizes, reuse them; copied without a sync, since the
    running loop queues its prefill behind decode steps it must not wait for."""
    import torch

    from ocrq.models.hunyuan.readback import to_device

    return to_device(list(edges), torch.int32, device)


def packed_qkv(
    attn: Any, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of a pass's packed row, each (patches, heads, head_dim): what
    every vision attention path here starts from (the varlen kernels and the grouped SDPA)."""
    batch, seq, _ = hidden_states.shape
    if batch != 1:
        raise ValueError(f"the vision tower packs images into one row, got {batch}")
    shape = (seq, attn.num_heads, attn.head_dim)
    merged = getattr(attn, "ocrq_qkv", None)  # fp8 linears: one product, one quantisation
    if merged is not None:  # (ocrq/models/hunyuan/vision_fp8.py)
        width = attn.num_heads * attn.head_dim
        q, k, v = (t.view(shape) for t in merged(hidden_states)[0].split(width, dim=-1))
        return q, k, v
    q = attn.q_proj(hidden_states).view(shape)
    k = attn.k_proj(hidden_states).view(shape)
    v = attn.v_proj(hidden_states).view(shape)
    return q, k, v


def varlen_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    kernel: VarlenKernel,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HunYuanVLVisionAttention.forward with every image of the pass in one varlen call.

    The tower packs a pass's images into one row and hands over their cumulative patch counts
    (on the host where the engine keeps the image grid there); each image attends over its own
    patches, as in the library's per-image loop."""
    q, k, v = packed_qkv(self, hidden_states)
    seq, heads, dim = q.shape
    edges = tuple(int(e) for e in cu_seqlens.tolist())
    if edges[0] != 0 or edges[-1] != seq:
        raise ValueError(f"cumulative lengths {edges[:3]}...{edges[-1]} do not cover {seq} patches")
    longest = max(b - a for a, b in itertools.pairwise(edges))
    out = kernel(q, k, v, device_bounds(edges, str(q.device)), longest, self.scaling)
    return self.o_proj(out.reshape(1, seq, heads * dim)), None
