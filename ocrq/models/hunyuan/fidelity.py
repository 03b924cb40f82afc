"""Where ocrq follows the code HunyuanOCR was trained with rather than transformers' HunYuanVL.

Two numeric details of transformers 5.13-5.24 depart from Tencent's training code
(Tencent-Hunyuan/HunyuanOCR `train/modeling_hunyuan_vl.py`, which vLLM's former native
HunYuanVL also followed). Both only change image tokens; text tokens and every decode step are
untouched. Each is a setting (`OCRQ_HUNYUAN_ROPE`, `OCRQ_HUNYUAN_VIT_POSITIONS`) whose default,
"trained", is the training code; "transformers" keeps the library's behaviour, for comparison
with transformers' or vLLM's outputs.

* XD-RoPE layout. Rotary dimension d is driven by one of the four position axes (p, w, h, t).
  Training repeats the section list (`xdrope_section * 2`: eight chunks, chunk i from axis
  i % 4), so both halves of a rotate-half pair (d, d + D/2) share an axis and a frequency and
  q.k stays a function of relative position. transformers doubles each section (four chunks of
  2 * section), so the two halves of a pair rotate by different axes.
* ViT position table. Training interpolates the 128x128 learned table with
  `scale_factor=((h + 0.1) / 128, (w + 0.1) / 128)` (bilinear, align_corners=False; the +0.1 is
  DINO's guard against a floor landing one short); transformers passes `size=(h, w)`, which
  samples with scale h/128 and so shifts every patch by up to ~0.1 * 128 / h source cells.

The layout is installed on one model instance (`follow_training`), so transformers' own forward
(`generate()`, the unfused prefill) and ocrq's fused paths, which read the layout back from the
instance (`rope_layout_of`), always agree with each other in either mode.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Numerics = Literal["trained", "transformers"]
NUMERICS: tuple[str, ...] = ("trained", "transformers")

_LAYOUT_ATTR = "ocrq_rope_layout"


def axis_of_dim(sections: Sequence[int], head_dim: int, layout: Numerics) -> list[int]:
    """The position axis that drives each of the `head_dim` rotary dimensions.

    `sections` are the config's per-axis frequency counts (summing to head_dim / 2)."""
    if layout not in NUMERICS:
        raise ValueError(f"RoPE layout must be one of {NUMERICS}, not {layout!r}")
    if not sections:
        return [0] * head_dim
    axes = len(sections)
    if layout == "trained":
        chunks = [(i % axes, int(w)) for i, w in enumerate(list(sections) * 2)]
    else:
        chunks = [(i % axes, 2 * int(w)) for i, w in enumerate(sections)]
    out = [axis for axis, width in chunks for _ in range(width)]
    if len(out) != head_dim:
        raise ValueError(f"mrope sections {list(sections)} do not cover head_dim {head_dim}")
    return out


def rope_layout_of(model: Any) -> Numerics:
    """The layout installed on this instance; transformers' where none was."""
    rotary = model.model.language_model.rotary_emb
    return getattr(rotary, _LAYOUT_ATTR, "transformers")


def follow_training(model: Any, *, rope: Numerics, vit_positions: Numerics) -> None:
    """Install the RoPE layout and the ViT position interpolation on this model instance.

    Bound methods on the instance only: the class, other models and the library's own tests see
    the library as it is. Calling it again with other modes replaces what it installed."""
    _install_rope(model, rope)
    _install_vit_positions(model, vit_positions)


def _install_rope(model: Any, layout: Numerics) -> None:
    import torch

    rotary = model.model.language_model.rotary_emb
    sections = list(rotary.mrope_section or [])
    head_dim = 2 * int(rotary.inv_freq.numel())
    axes = axis_of_dim(sections, head_dim, layout)  # validates the layout before any change
    rotary.__dict__.pop("recomposition_frequencies", None)
    setattr(rotary, _LAYOUT_ATTR, layout)
    if layout == "transformers" or not sections:
        return
    index = torch.tensor(axes, dtype=torch.long, device=rotary.inv_freq.device)

    def recomposition_frequencies(self: Any, freq: torch.Tensor) -> torch.Tensor:
        # freq: (axes, batch, seq, D/2) -> (batch, seq, D), dimension d taken from its axis.
        full = torch.cat((freq, freq), dim=-1).movedim(0, -1)  # (batch, seq, D, axes)
        at = index.to(full.device).view(*([1] * (full.dim() - 2)), -1, 1)
        return full.gather(-1, at.expand(*full.shape[:-1], 1)).squeeze(-1)

    rotary.recomposition_frequencies = types.MethodType(recomposition_frequencies, rotary)


def interpolate_positions(
    table: torch.Tensor, height: int, width: int, mode: Numerics, interpolate_mode: str
) -> torch.Tensor:
    """The (1, C, E, E) position table resampled to (1, C, height, width), float32.

    "trained" is the training code's call, `interpolate(scale_factor=(n + 0.1) / E)`, as it
    computes on CUDA, where the model was trained: output cell i samples source coordinate
    (i + 0.5) / scale - 0.5 on each axis. torch's CPU kernel departs from that in one case:
    it leaves an axis whose size does not change untouched (CUDA does so only when both keep
    their size), so a grid with exactly one side equal to E is resampled here with the formula
    written out, the same numbers on every device."""
    import torch.nn.functional as F

    if mode not in NUMERICS:
        raise ValueError(f"ViT position interpolation must be one of {NUMERICS}, not {mode!r}")
    table = table.float()
    if mode == "transformers":
        return F.interpolate(table, size=(height, width), mode=interpolate_mode,
                             align_corners=False)
    edge_h, edge_w = table.shape[-2:]
    if interpolate_mode == "bilinear" and (height == edge_h) != (width == edge_w):
        out = _lerp_axis(table, -1, *_bilinear_taps(width, edge_w, table.device))
        return _lerp_axis(out, -2, *_bilinear_taps(height, edge_h, table.device))
    out = F.interpolate(
        table,
        scale_factor=((height + 0.1) / edge_h, (width + 0.1) / edge_w),
        mode=interpolate_mode,
        align_corners=False,
    )
    if tuple(out.shape[-2:]) != (height, width):  # cannot happen for grids up to 10^5 a side
        raise ValueError(f"position table resampled to {tuple(out.shape[-2:])}, "
                         f"not {(height, width)}")
    return out


def _bilinear_taps(
    out_size: int, in_size: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each output cell's two source cells and the weight of the second (align_corners=False,
    scale (out + 0.1) / in, source coordinates clamped at 0 and neighbours at the edge)."""
    import torch

    scale = (out_size + 0.1) / in_size
    x = ((torch.arange(out_size, device=device, dtype=torch.float32) + 0.5) / scale - 0.5)
    x = x.clamp(min=0.0)
    lo = x.floor().long().clamp(max=in_size - 1)
    hi = (lo + 1).clamp(max=in_size - 1)
    return lo, hi, x - lo.float()


def _lerp_axis(
    x: torch.Tensor, axis: int, lo: torch.Tensor, hi: torch.Tensor, frac: torch.Tensor
) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[axis] = -1
    frac = frac.view(shape)
    return x.index_select(axis, lo) * (1 - frac) + x.index_select(axis, hi) * frac


def _install_vit_positions(model: Any, mode: Numerics) -> None:
    embed = model.model.vision_tower.embeddings
    embed.__dict__.pop("interpolate_pos_encoding", None)
    if mode not in NUMERICS:
        raise ValueError(f"ViT position interpolation must be one of {NUMERICS}, not {mode!r}")
    if mode == "transformers":
        return

    def interpolate_pos_encoding(
        self: Any, embeddings: torch.Tensor, height: int, width: int
    ) -> torch.Tensor:
        edge = self.position_edge
        table = self.position_embedding.weight[1:, :].reshape(1, edge, edge, self.embed_dim)
        out = interpolate_positions(
            table.permute(0, 3, 1, 2), int(height), int(width), mode, self.config.interpolate_mode
        )
        return out.permute(0, 2, 3, 1).reshape(1, -1, self.embed_dim).to(embeddings.dtype)

    embed.interpolate_pos_encoding = types.MethodType(interpolate_pos_encoding, embed)
