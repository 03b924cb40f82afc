"""Two changes to transformers' HunYuanVL, installed on one loaded model instance.

Why patch at all: each fixes a difference between a batch and a batch of one, or a cost that
only a batch has, that the library's code leaves; both keep the library's own arithmetic.

* `isolate_rows`: the library numbers images across the rows of a batch on the last
  multimodal-RoPE axis (image 0, 1, 2... over the whole batch), while the model was trained, and
  a batch of one runs, with each sequence's image numbered 0. Without it, row i > 0 of a batch
  does not get the output it gets alone.
* `batch_vision_attention`: the vision tower's sdpa path makes one attention call per image and
  layer (27 x batch calls, ~1 ms of host time each), so a large batch's prefill is host-bound;
  equal-sized images go through one call instead; with FlashAttention-4 installed, every image
  of the pass goes through one varlen call (ocrq/models/hunyuan/vision_attention.py).

The two places where ocrq follows the training code over the library's numerics (the XD-RoPE
layout, the ViT position interpolation) are installed the same way, by
ocrq/models/hunyuan/fidelity.py.

Only this instance's methods change (bound methods set on the instance, the class untouched), so
another model in the process, or the library's own tests, see the library as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.vision_attention import VarlenKernel, packed_qkv, varlen_forward

if TYPE_CHECKING:
    import torch


def isolate_rows(model: Any) -> None:
    """Compute multimodal RoPE positions row by row, so no row sees another row's images.

    transformers' `get_rope_index` gives every image an index on the last RoPE axis counted over
    the whole batch; a batch-of-one run (and training) numbers each sequence's images from 0.
    Wrapping the bound method on this instance keeps the library's own position logic, applied
    to one row at a time.
    """
    import torch

    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.shape[0] == 1 or image_grid_thw is None:
            return original(
                input_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=image_grid_thw,
                attention_mask=attention_mask,
                **kwargs,
            )
        positions, deltas = [], []
        next_grid = 0
        for row in range(input_ids.shape[0]):
            types = mm_token_type_ids[row]
            mask = attention_mask[row : row + 1] if attention_mask is not None else None
            if mask is not None:
                types = types[mask[0].bool()]
            is_image = types == 1
            n_images = int(is_image[0]) + int((is_image[1:] & ~is_image[:-1]).sum())
            grids = image_grid_thw[next_grid : next_grid + n_images]
            next_grid += n_images
            pos, delta = original(
                input_ids[row : row + 1],
                mm_token_type_ids=mm_token_type_ids[row : row + 1],
                image_grid_thw=grids,
                attention_mask=mask,
                **kwargs,
            )
            positions.append(pos)
            deltas.append(delta)
        return torch.cat(positions, dim=1), torch.cat(deltas, dim=0)

    inner.get_rope_index = get_rope_index


def batch_vision_attention(
    model: Any, enabled: bool = True, kernel: VarlenKernel | None = None
) -> None:
    """Run the vision tower's attention as one sdpa call per run of equal-sized images, or,
    given a varlen `kernel` (FlashAttention-4, ocrq/models/hunyuan/vision_attention.py), as one
    call per layer over every image of the pass.

    transformers' sdpa path loops over the images of a batch, one sdpa call per image and layer
    (27 x batch calls, ~1 ms of host time each), which makes the prefill of a large batch
    host-bound. Consecutive images with the same patch count are strided views of one tensor, so
    they go through one call with a batch dimension: the same per-image arithmetic, no copies,
    no cross-image attention. Installed on this model's instances only; `enabled=False` restores
    the library's method (the bench measures both). Other attention implementations are left as
    they are.
    """
    import functools
    import types

    tower = model.model.vision_tower
    if getattr(tower.config, "_attn_implementation", "sdpa") != "sdpa":
        return
    for layer in tower.layers:
        attn = layer.self_attn
        if not enabled:
            attn.__dict__.pop("forward", None)
            continue
        if kernel is not None:
            forward = functools.partial(varlen_forward, kernel=kernel)
            attn.forward = types.MethodType(forward, attn)
        else:
            attn.forward = types.MethodType(_grouped_vision_attention, attn)


def _grouped_vision_attention(
    self: Any,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HunYuanVLVisionAttention.forward for sdpa, batched over runs of equal-length images."""
    import torch
    import torch.nn.functional as F

    q, k, v = packed_qkv(self, hidden_states)
    seq, heads, dim = q.shape
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outputs = []
    offset = 0
    i = 0
    while i < len(lengths):
        n = lengths[i]
        count = 1
        while i + count < len(lengths) and lengths[i + count] == n:
            count += 1
        span = slice(offset, offset + n * count)

        def images(
            x: torch.Tensor, span: slice = span, count: int = count, n: int = n
        ) -> torch.Tensor:
            return x[span].view(count, n, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            images(q), images(k), images(v), dropout_p=0.0, scale=self.scaling, is_causal=False
        )
        outputs.append(out.transpose(1, 2).reshape(count * n, heads * dim))
        offset += n * count
        i += count
    merged = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return self.o_proj(merged.view(1, seq, heads * dim)), None
