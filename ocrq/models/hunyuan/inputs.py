"""One image's model inputs, made in a prefetch thread, and a batch of them padded together.

Why the split: resizing, normalising and patchifying a page, tokenising its row and computing its
multimodal RoPE positions cost milliseconds of CPU a page (35-110 ms through transformers'
processor on an H200 host's core), so the prefetch threads make them while the device runs the
batch before (`Preprocessor`); the thread that feeds the device only pads rows together and
copies them over (`collate`). By default the rows are made by ocrq's own tensor ops
(ocrq/models/hunyuan/pixels.py and spans.py, equal to the processor's output, the GIL released
while they run); OCRQ_PREPROCESS=processor runs transformers' processor instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocrq.models.base import PreparedImage
from ocrq.models.hunyuan.geometry import ImageGeometry
from ocrq.models.hunyuan.pixels import PixelEncoder, PixelSpec
from ocrq.models.hunyuan.prompts import PromptTemplates
from ocrq.models.hunyuan.readback import to_device
from ocrq.models.hunyuan.spans import RowSpans

if TYPE_CHECKING:
    import torch
    from PIL import Image

PREPROCESS_MODES = ("tensor", "processor")

# Prefetch threads that may run transformers' processor at once. Its Python holds the GIL, and
# the thread that feeds the GPU needs the GIL to launch each batch's thousands of kernels: 16
# prefetch threads at once slowed a batch of 64 pages by 14-25% on the H200, 2 at once by nothing
# measurable, while 1 could not keep up (bench/results/prefill_profile/prefill_profile_h200.md,
# "Prefetch beside a batch").
PREPROCESS_SLOTS = 2


TENSOR_SLOTS = 2


def tensor_slots() -> int:
    """Prefetch threads that may run the tensor path at once: 2, as for the processor.

    Why not one per core: measured on the H200 host
    (bench/results/preprocess_speed/preprocess_speed_h200.md), 15 threads in the tensor path made
    299 A4 pages/s but left a busy GPU-feeding thread 4% of its rate (its many small ops each take
    the GIL back), while 2 processor threads left it 58-74%. One tensor thread already makes 70 A4
    pages/s there (140 receipts at 2), over 10x the ~5-15 pages/s the GPU takes, so two threads keep
    preprocessing off the critical path without starving the thread that launches the GPU's
    kernels."""
    return TENSOR_SLOTS


@dataclass
class EncodedImage:
    """One image after the processor: its prompt row and its vision inputs (CPU tensors)."""

    input_ids: torch.Tensor  # (seq,), image placeholder expanded to N tokens
    mm_token_type_ids: torch.Tensor  # (seq,), 1 on image tokens
    pixel_values: torch.Tensor  # (P, 3 * 16 * 16), already in the model's dtype
    image_grid_thw: torch.Tensor  # (1, 3)
    # (axes, seq) multimodal RoPE positions of this row alone; None when not computed
    positions: torch.Tensor | None = None


@dataclass(frozen=True)
class HostLayout:
    """What the host knows of a collated, left-padded batch, so that its prefill asks the device
    nothing: each question (`.tolist()` of a device tensor, a boolean index, a `bool()`) would be
    a sync, emptying the queue of decode steps the running loop keeps ahead of the GPU.

    `grid` on the CPU keeps the vision tower's per-image splits and sequence lengths host
    arithmetic (with it on the device, transformers' HunYuanVL syncs in every vision layer)."""

    grid: torch.Tensor  # (images, 3), CPU
    padded: bool  # rows of different lengths: the causal mask must hide the padding
    image_at: torch.Tensor  # flat (row * width + column) index of each image token, on the device


def host_layout(
    rows: Sequence[EncodedImage], image_token_id: int, device: Any
) -> HostLayout:
    import torch

    lengths = [int(r.input_ids.shape[0]) for r in rows]
    width = max(lengths)
    starts = [i * width + width - n for i, n in enumerate(lengths)]  # left padding
    return HostLayout(
        grid=torch.cat([r.image_grid_thw for r in rows], dim=0),
        padded=len(set(lengths)) > 1,
        image_at=to_device(image_token_at(rows, image_token_id, starts), torch.long, device),
    )


def image_token_at(
    rows: Sequence[EncodedImage], image_token_id: int, starts: Sequence[int]
) -> torch.Tensor:
    """Flat indices of every image token when row i's tokens begin at `starts[i]` of one
    stream (padded or packed): where the vision tower's features go."""
    import torch

    return torch.cat([
        (r.input_ids == image_token_id).nonzero()[:, 0] + start
        for r, start in zip(rows, starts, strict=False)
    ])


def device_pixels(rows: Sequence[EncodedImage], device: Any, dtype: Any) -> torch.Tensor:
    """Every row's pixels in one device tensor of `dtype`, copied row by row (asynchronously
    from pinned rows) instead of concatenated on the CPU first."""
    import torch

    total = sum(int(r.pixel_values.shape[0]) for r in rows)
    pixels = torch.empty((total, rows[0].pixel_values.shape[1]), dtype=dtype, device=device)
    offset = 0
    for r in rows:
        n = int(r.pixel_values.shape[0])
        pixels[offset : offset + n].copy_(r.pixel_values, non_blocking=True)
        offset += n
    return pixels


class Preprocessor:
    """The processor run on one image at a time, safe to call from many threads."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        templates: PromptTemplates,
        geometry: ImageGeometry,
        *,
        pin: bool,
        prompt_for: Callable[[PreparedImage], str],
        cap_of: Callable[[PreparedImage], int],
        mode: str = "tensor",
    ) -> None:
        """`pin`: stage pixels in pinned host memory (the model is on a GPU). `prompt_for`: the
        loaded version's instruction for an item; `cap_of`: its resolution preset in pixels.
        `mode`: "tensor" (ocrq's torch ops) or "processor" (transformers' processor)."""
        if mode not in PREPROCESS_MODES:
            raise ValueError(f"preprocess mode must be one of {PREPROCESS_MODES}, not {mode!r}")
        self.model = model
        self.processor = processor
        self.templates = templates
        self.geometry = geometry
        self.pin = pin
        self.prompt_for = prompt_for
        self.cap_of = cap_of
        self.mode = mode
        self.limit = tensor_slots() if mode == "tensor" else PREPROCESS_SLOTS
        self.slots = threading.BoundedSemaphore(self.limit)
        self.pixels: PixelEncoder | None = None
        self.spans: RowSpans | None = None
        if mode == "tensor":
            self.pixels = PixelEncoder(
                PixelSpec.of(processor.image_processor), geometry, dtype=model.dtype, pin=pin
            )
            config = model.config
            axes = len((config.text_config.rope_parameters or {}).get("mrope_section", []))
            self.spans = RowSpans(processor, axes, int(config.vision_config.spatial_merge_size))

    def __call__(self, item: PreparedImage) -> EncodedImage:
        image = item.image if item.image.mode == "RGB" else item.image.convert("RGB")
        image = fit_to_cap(image, self.geometry, self.cap_of(item))
        text, _ = self.templates(self.prompt_for(item))
        with self.slots:
            return self.encode(text, image)

    def encode(self, text: str, image: Image.Image) -> EncodedImage:
        """The row of `text` (a templated prompt) and `image` (RGB, already capped)."""
        if self.pixels is not None and self.spans is not None:
            pixels, grid = self.pixels(image)
            ids, types, positions = self.spans(text, grid)
            return EncodedImage(
                input_ids=ids,
                mm_token_type_ids=types,
                pixel_values=pixels,
                image_grid_thw=grid,
                positions=positions,
            )
        return self.encode_by_processor(text, image)

    def encode_by_processor(self, text: str, image: Image.Image) -> EncodedImage:
        """The row as transformers' processor and `get_rope_index` make it."""
        enc = self.processor(text=[text], images=[image], return_tensors="pt")
        return EncodedImage(
            input_ids=enc["input_ids"][0],
            mm_token_type_ids=enc["mm_token_type_ids"][0],
            pixel_values=self._staged_pixels(enc["pixel_values"]),
            image_grid_thw=enc["image_grid_thw"],
            positions=self._row_positions(enc),
        )

    def _staged_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """The row's pixels in the model's dtype and, on a GPU, in pinned host memory.

        Why in the prefetch thread: the batcher thread then neither casts nor concatenates a
        batch on the CPU while the GPU waits, and copies each row to the device asynchronously
        (pinned memory). Collated the plain way (float32 cast, one CPU `cat`, one pageable copy)
        with prefetch running beside it, a batch of 128 pages spent 0.75 s (1024²) to 1.4 s (A4)
        outside its prefill and decode (bench/results/decode_speed/decode_speed_h200_step1.json).
        """
        pixels = pixels.to(self.model.dtype)
        if self.pin:
            pixels = pixels.pin_memory()  # torch's caching host allocator reuses these blocks
        return pixels

    def _row_positions(self, enc: Any) -> torch.Tensor:
        """This row's multimodal RoPE positions, by the library's own `get_rope_index` on the CPU.

        Why here: the positions depend on the row alone (ocrq/models/hunyuan/patches.py), and the
        library computes them with a Python loop over every prompt token with a device sync per
        row, 0.28 s (1024² pages) to 0.45 s (A4) of an idle GPU per batch of 64 measured on an
        H200 (bench/results/prefill_profile/prefill_profile_h200_before.md). In the prefetch thread
        that cost overlaps the GPU's work on the batch before.
        """
        import torch

        with torch.no_grad():
            positions, _ = self.model.model.get_rope_index(
                enc["input_ids"],
                mm_token_type_ids=enc["mm_token_type_ids"],
                image_grid_thw=enc["image_grid_thw"],
            )
        return positions[:, 0]


def fit_to_cap(image: Image.Image, geometry: ImageGeometry, cap: int) -> Image.Image:
    """`image` resized (bicubic, as the processor resizes) so that the model sees at most `cap`
    pixels of it; the image itself when the cap changes nothing. Also raises ImageShapeError for
    a shape the processor would refuse, before the processor's own error."""
    from PIL import Image

    geometry.resized(*image.size)
    size = geometry.shrink_to(*image.size, cap)
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def collate(
    rows: Sequence[EncodedImage],
    pad_id: int,
    *,
    device: Any = None,
    dtype: Any = None,
    padding_side: str = "left",
) -> dict[str, Any]:
    """One batch of model inputs from encoded rows, padded to the longest row.

    Left padding is the only correct choice for generation (the next token is read at the last
    position of every row); "right" exists so that tests can show the equality checks catch
    broken padding. With `device`, every tensor is returned there and the pixels are copied row
    by row into one device tensor of `dtype` (asynchronously from pinned rows) instead of being
    concatenated on the CPU first.
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")

    # One call per tensor kind, not a Python loop over rows: this runs in the thread that
    # feeds the GPU, while prefetch threads compete for the GIL.
    def padded(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
        return pad_sequence(
            tensors, batch_first=True, padding_value=value, padding_side=padding_side
        )

    inputs = {
        "input_ids": padded([r.input_ids for r in rows], pad_id),
        "attention_mask": padded([torch.ones_like(r.input_ids) for r in rows], 0),
        "mm_token_type_ids": padded([r.mm_token_type_ids for r in rows], 0),
        "image_grid_thw": torch.cat([r.image_grid_thw for r in rows], dim=0),
    }
    if all(r.positions is not None for r in rows):
        # (axes, B, L); padding columns hold position 0 on every axis, as the library's do.
        inputs["position_ids"] = padded(
            [r.positions.t() for r in rows],
            0,  # type: ignore[union-attr]
        ).permute(2, 0, 1)
    if device is None:
        inputs["pixel_values"] = torch.cat([r.pixel_values for r in rows], dim=0)
        return inputs
    # Without a sync: the running loop queues this behind decode steps it must not wait for.
    inputs = {k: to_device(v, v.dtype, device) for k, v in inputs.items()}
    inputs["pixel_values"] = device_pixels(rows, device, dtype)
    return inputs
