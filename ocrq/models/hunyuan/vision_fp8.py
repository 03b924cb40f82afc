"""The vision tower's linear layers in fp8 (e4m3): an opt-in lever for the prefill's GEMMs.

Why: an A4 page's prefill is ~83% vision tower, and once its attention runs on FlashAttention-4
(ocrq/models/hunyuan/vision_attention.py) the rest of the tower is GEMMs: per patch and layer
q, k, v, o (1152 x 1152 each) and the MLP (1152 x 4304 and back), ~7.5 TFLOP a page in bf16.
Hopper's tensor cores run e4m3 at twice bf16's rate. `Settings.vision_gemm_dtype="fp8"` swaps
those six linears of every vision layer for `Fp8Linear`; the default ("auto") leaves the model's
dtype, as Tencent's code runs it.

The scaling is the plainest one that keeps the error per row and per output channel:

* weights: one scale per output channel (its largest magnitude maps to e4m3's 448), quantised
  once at load, the model-dtype weights then freed;
* activations: one scale per row (patch), found at run time by a one-pass Triton kernel on a
  GPU (read the row once, write its e4m3 copy and its scale) and by the same arithmetic in
  torch elsewhere; so no calibration set and no state between passes;
* the product: `torch._scaled_mm` with both scale vectors, the bias added and the output in
  the model's dtype (cuBLASLt on a GPU; torch's own kernel on a CPU, which is how the tests run
  this path end to end).

q, k and v read the same normalised row: they become one (3 x 1152)-wide GEMM whose input is
quantised once (`Fp8Linear.merged`); `packed_qkv` uses it where a layer has one. The modules
q_proj, k_proj and v_proj stay, as row slices of it, for any path that calls them one by one.

The error is not free: each product rounds both operands to 3 mantissa bits. Measured
(bench/vision_fp8.py, bench/results/vision_fp8/README.md): on an H200 the tower of an A4 page
took 39.7 ms against 36.9 in bf16, since per-row-scaled products gain little over bf16 at these
shapes and quantising each input costs more than they save, and its features moved 9% where two
bf16 attention kernels differ by 1.5%. So it stays off and is not recommended on Hopper; it
stays in the code to be measured again on later GPUs and libraries.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import torch  # imported where the setting asks for fp8 (engine.load), never by the engine module

FP8_MAX = 448.0  # e4m3's largest finite value
# The smallest scale a row may have: an all-zero row quantises to zeros, not NaNs.
MIN_SCALE = 1e-12
# torch._scaled_mm needs both dimensions of a weight in multiples of 16 (cuBLASLt's fp8 rule).
ALIGN = 16
# The vision layer's linears this swaps: (module attribute, linear names).
LAYER_LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                 ("mlp", ("fc1", "fc2")))


def fp8_unusable(device: Any) -> str | None:
    """Why fp8 GEMMs with per-row scales cannot run on `device`, or None where they can."""
    dev = torch.device(device)
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 matmul"
    if dev.type == "cpu":
        return None  # torch's own kernel: slow, exact to the same arithmetic (the tests' path)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"it needs an NVIDIA GPU or the CPU (device {device})"
    if torch.version.hip is not None:
        return "it needs CUDA, not ROCm"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 9:  # per-row scales: cuBLASLt's rowwise fp8 path is Hopper and later
        return f"per-row fp8 scales need an SM90 or later GPU, this one is SM{major}{minor}"
    return None


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scales (rows, 1)) of a 2-D `x`: each row's largest magnitude maps to
    448. The reference arithmetic (float32 throughout); the Triton kernel does the same."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(MIN_SCALE * FP8_MAX) / FP8_MAX
    return (xf / scale).to(torch.float8_e4m3fn), scale


@lru_cache(maxsize=1)
def _quantize_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(X, Q, S, n_cols, s_x, s_q, min_amax,
                             FP8: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(X + row * s_x + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), 0), min_amax)
        scale = amax / FP8
        y = tl.math.div_rn(x, scale)  # IEEE division, as torch divides
        tl.store(Q + row * s_q + cols, y.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=ok)
        tl.store(S + row, scale)

    return quantize_rows_kernel


def use_kernel(x: torch.Tensor) -> bool:
    """The Triton kernel on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
    as the tests run it); torch's arithmetic otherwise."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_torch`, in one pass over `x` where the Triton kernel runs."""
    if not use_kernel(x):
        return quantize_rows_torch(x)
    import triton

    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _quantize_kernel()[(rows,)](
            x, q, scale, cols, x.stride(0), q.stride(0), MIN_SCALE * FP8_MAX, FP8=FP8_MAX,
            BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight (out, in), float32 scales (1, out)): one scale per output channel."""
    q, scale = quantize_rows_torch(weight.detach())
    return q, scale.reshape(1, -1).contiguous()


class Fp8Linear(torch.nn.Module):
    """A linear layer whose product runs in e4m3 with per-row and per-channel scales (see the
    module doc); its output has the input's dtype."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = int(weight_q.shape[1])
        self.out_features = int(weight_q.shape[0])
        self.register_buffer("weight_q", weight_q, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def of(cls, linear: Any) -> Fp8Linear:
        q, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias)

    @classmethod
    def merged(cls, linears: list[Any]) -> tuple[Fp8Linear, list[Fp8Linear]]:
        """One Fp8Linear over the linears' outputs side by side, and one per linear over its
        own rows of it (views: no second copy of the weights)."""
        parts = [cls.of(lin) for lin in linears]
        if any(p.bias is None for p in parts) and any(p.bias is not None for p in parts):
            raise ValueError("merged linears need a bias on all of them or on none")
        whole = cls(
            torch.cat([p.weight_q for p in parts]),
            torch.cat([p.weight_scale for p in parts], dim=1),
            None if parts[0].bias is None else torch.cat([p.bias for p in parts]),
        )
        views, at = [], 0
        for p in parts:
            n = p.out_features
            views.append(cls(whole.weight_q[at:at + n], whole.weight_scale[:, at:at + n],
                             None if whole.bias is None else whole.bias[at:at + n]))
            at += n
        return whole, views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, scale = quantize_rows(x.reshape(-1, self.in_features))
        out = torch._scaled_mm(
            q, self.weight_q.t(), scale_a=scale, scale_b=self.weight_scale,
            bias=None if self.bias is None else self.bias.to(x.dtype), out_dtype=x.dtype,
        )
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, e4m3")


def swappable(linear: Any) -> bool:
    """Whether `linear` can run as an Fp8Linear: a 2-D floating weight aligned for fp8."""
    weight = getattr(linear, "weight", None)
    return (weight is not None and weight.dim() == 2 and weight.is_floating_point()
            and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0)


def fp8_vision_linears(model: Any) -> int:
    """Swap the six linears of every vision layer of `model` (a HunYuanVL model) for
    Fp8Linear, q/k/v as one merged product (`attn.ocrq_qkv`); returns how many layers changed.
    Idempotent: a layer swapped before is left as it is. A linear whose shape fp8 cannot take
    stays in the model's dtype (none in HunyuanOCR's shapes)."""
    tower = model.model.vision_tower
    changed = 0
    for layer in tower.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn.o_proj, Fp8Linear) or isinstance(mlp.fc1, Fp8Linear):
            continue
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        if all(swappable(lin) for lin in qkv):
            attn.ocrq_qkv, (attn.q_proj, attn.k_proj, attn.v_proj) = Fp8Linear.merged(qkv)
        for owner, name in ((attn, "o_proj"), (mlp, "fc1"), (mlp, "fc2")):
            lin = getattr(owner, name)
            if swappable(lin):
                setattr(owner, name, Fp8Linear.of(lin))
        changed += 1
    return changed
