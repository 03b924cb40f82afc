"""One row's token ids and multimodal RoPE positions around its image span, by arithmetic.

Why not the processor and `get_rope_index`: a row is always a cached prompt template whose single
image placeholder becomes N image tokens, N = (h/32)(w/32 + 1) + 2 from the image's grid alone.
The processor writes N placeholders into the text and tokenises it again for every image, and the
library's `get_rope_index` walks every token in Python; both hold the GIL that the thread feeding
the GPU needs. Here the template is tokenised once, the row is three concatenated pieces and its
positions a handful of tensor ops.

What it reproduces (transformers 5.x HunYuanVLProcessor and HunYuanVLModel.get_rope_index, one
image per row, images numbered from 0 in each row as `isolate_rows` keeps them):

* input_ids: the template's tokens with the placeholder repeated N times, N = gh/m * (gw/m + 1)
  plus 2 when the processor's `cat_extra_token` is set (the image span's begin/end slots);
* mm_token_type_ids: 1 on the processor's image token ids, 0 elsewhere;
* positions: 0..L-1 on every axis; over the grid tokens (the span less its first and last
  token) the last three axes hold (column 0..gw/m, row, image index 0).

A tokenizer that does not keep the placeholder as one token whatever surrounds it would make the
spliced row differ from the processor's; each template is checked once against the tokenizer
with the placeholder repeated, and refused (ValueError) if it differs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CACHE_SIZE = 256  # templates kept; a job's prompt is nearly always one of a dozen presets


class RowSpans:
    """Token ids, modality types and RoPE positions of one image's row; thread-safe."""

    def __init__(self, processor: Any, rope_axes: int, spatial_merge_size: int) -> None:
        """`processor`: the loaded HunYuanVLProcessor (its tokenizer and image tokens).
        `rope_axes`: len(text_config.rope_parameters["mrope_section"]); `spatial_merge_size`:
        vision_config.spatial_merge_size (the model's, as get_rope_index reads it)."""
        if rope_axes < 3:
            raise ValueError(f"HunYuanVL needs at least 3 multimodal RoPE axes, got {rope_axes}")
        self.tokenizer = processor.tokenizer
        self.image_token: str = processor.image_token
        self.image_token_id = int(processor.image_token_id)
        self.type_ids = [int(i) for i in processor.image_token_ids if i is not None]
        self.merge = int(processor.image_processor.merge_size)
        self.spatial_patch = int(getattr(processor.image_processor, "spatial_patch_size", 1))
        self.extra = 2 if getattr(processor, "cat_extra_token", True) else 0
        self.rope_axes = rope_axes
        self.spatial_merge_size = spatial_merge_size
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def image_tokens(self, grid_h: int, grid_w: int) -> int:
        """N, as the processor's `replace_image_token` counts it."""
        rows = grid_h // self.merge // self.spatial_patch
        cols = grid_w // self.merge // self.spatial_patch
        return rows * (cols + 1) + self.extra

    def __call__(
        self, text: str, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids (L,), mm_token_type_ids (L,), positions (axes, L)) of `text`, a templated
        prompt holding one image placeholder, for an image of grid `grid_thw` (1, 3)."""
        import torch

        _, grid_h, grid_w = (int(v) for v in grid_thw[0])
        prefix, suffix = self.pieces(text)
        n = self.image_tokens(grid_h, grid_w)
        image = torch.full((n,), self.image_token_id, dtype=torch.long)
        ids = torch.cat([prefix, image, suffix])
        types = torch.isin(ids, torch.tensor(self.type_ids, dtype=torch.long)).long()
        positions = self.positions(len(ids), len(prefix), n, grid_h, grid_w)
        return ids, types, positions

    def positions(self, length: int, start: int, span: int, grid_h: int, grid_w: int) -> Any:
        """get_rope_index's positions for one row whose image span is [start, start + span)."""
        import torch

        rows = grid_h // self.spatial_merge_size
        cols = grid_w // self.spatial_merge_size + 1  # the newline token closing every row
        grid = rows * cols
        if span == grid + 2:
            first = start + 1
        elif span == grid:
            first = start
        else:
            raise ValueError(f"image span of {span} tokens does not match a {rows}x{cols} grid")
        out = torch.arange(length, dtype=torch.long).expand(self.rope_axes, length).clone()
        axis = self.rope_axes - 3
        out[axis, first : first + grid] = torch.arange(cols, dtype=torch.long).repeat(rows)
        out[axis + 1, first : first + grid] = torch.arange(
            rows, dtype=torch.long
        ).repeat_interleave(cols)
        out[axis + 2, first : first + grid] = 0
        return out

    def pieces(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The template's token ids before and after its one image placeholder (cached)."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        entry = self._split(text)
        with self._lock:
            self._cache[text] = entry
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return entry

    def _split(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        if text.count(self.image_token) != 1:
            raise ValueError(
                f"a row's prompt must hold exactly one {self.image_token!r}, "
                f"found {text.count(self.image_token)}"
            )
        ids = self._ids(text)
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != 1:
            raise ValueError(f"the tokenizer made {len(where)} image tokens of one placeholder")
        prefix, suffix = ids[: where[0]], ids[where[0] + 1 :]
        repeated = self._ids(text.replace(self.image_token, self.image_token * 3))
        if repeated != prefix + [self.image_token_id] * 3 + suffix:
            raise ValueError(
                "the tokenizer does not keep the image placeholder as one token beside others; "
                "use OCRQ_PREPROCESS=processor"
            )
        return torch.tensor(prefix, dtype=torch.long), torch.tensor(suffix, dtype=torch.long)

    def _ids(self, text: str) -> list[int]:
        # The processor's text kwargs: no special tokens added (the template has them).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
