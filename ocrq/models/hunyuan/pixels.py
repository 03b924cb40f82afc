"""One image's vision inputs (pixel_values, image_grid_thw) as a few torch ops, not the processor.

Why not the processor: transformers' HunYuanVL image processor is torch too, but it reaches its
few kernels through layers of Python (kwargs merging, validation, grouping by shape, BatchFeature)
that hold the GIL, copies the image to channels-first before resizing (the slow path of torch's
uint8 resize), and returns float32 that ocrq then casts and pins in two more passes. The thread
that feeds the GPU needs the GIL for every kernel launch, so ocrq let only two prefetch threads
into the processor at once (bench/results/prefill_profile/prefill_profile_h200.md), which capped an
H200 near 18 A4 pages/s. Here each step is one torch call that releases the GIL while it runs, and
the pixels are written once, in the model's dtype, straight into pinned memory when the model is on
a GPU.

What it reproduces (transformers 5.x `HunYuanVLImageProcessor`, torchvision backend):

* resize to `smart_resize`'s size (ImageGeometry.resized) with bicubic and antialias, whatever
  the checkpoint's `resample` says (the processor overrides it to bicubic too); on the CPU the
  uint8 image goes through torch's native uint8 kernel, as the processor's does, so the resized
  pixels are equal; elsewhere through float32, then clamped and rounded back to uint8, as
  torchvision does on a GPU (not equal: the uint8 kernel rounds and clips between its two
  passes, so ~10% of pixels differ by a level and a few in 10,000 by up to ~10 beside sharp
  text edges; tests/test_hunyuan_pixels.py);
* rescale and normalise fused as the processor fuses them: (x - mean/rescale) / (std/rescale)
  in float32, a subtraction then a division;
* patches in raster order over the (h/16, w/16) grid (HunYuanVL's "row-major" order, not Qwen's
  merge-window order), each row C x temporal x 16 x 16 with the channel outermost;
* image_grid_thw = [[1, h/16, w/16]].

Where it runs: on the CPU, in the prefetch threads. On a GPU it would also run (`device`), but
the rows would then wait for their batch in GPU memory, the feeding thread would launch their
kernels, and the GPU's float resize is not the processor's (above); the host-to-device
copy it would save (bf16 -> uint8, half) is milliseconds of a batch that runs for seconds.
bench/preprocess_speed.py measures both.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.geometry import ImageGeometry

if TYPE_CHECKING:
    import torch
    from PIL import Image

# np.asarray of a PIL image is a read-only view of the bytes PIL hands out; torch warns that
# writing to it would be undefined. Nothing here writes to it, and copying it to make it writable
# costs an A4 page 5 ms, so the warning is silenced for this module's call only.
warnings.filterwarnings(
    "ignore",
    message="The given NumPy array is not writable",
    category=UserWarning,
    module=r"ocrq\.models\.hunyuan\.pixels",
)


@dataclass(frozen=True)
class PixelSpec:
    """The normalisation and patch layout of a loaded image processor."""

    patch_size: int = 16
    temporal_patch_size: int = 1
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def of(cls, image_processor: Any) -> PixelSpec:
        """Read from a loaded HunYuanVLImageProcessor; refuses a configuration this module does
        not reproduce rather than feed the model other pixels."""
        ip = image_processor
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if not getattr(ip, flag, True):
                raise ValueError(
                    f"the image processor has {flag}=False; use OCRQ_PREPROCESS=processor"
                )
        return cls(
            patch_size=int(ip.patch_size),
            temporal_patch_size=int(getattr(ip, "temporal_patch_size", 1) or 1),
            rescale_factor=float(ip.rescale_factor),
            image_mean=tuple(float(v) for v in ip.image_mean),
            image_std=tuple(float(v) for v in ip.image_std),
        )


class PixelEncoder:
    """PIL image -> (pixel_values, image_grid_thw) equal to the processor's; thread-safe."""

    def __init__(
        self,
        spec: PixelSpec,
        geometry: ImageGeometry,
        *,
        dtype: Any = None,
        device: Any = "cpu",
        pin: bool = False,
    ) -> None:
        """`dtype`: of the returned pixels (the model's; float32 by default). `pin`: allocate
        them in pinned host memory (CPU only), so the batch's copy to the GPU is asynchronous."""
        import torch

        self.spec = spec
        self.geometry = geometry
        self.dtype = dtype or torch.float32
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu"
        # The processor's fused rescale+normalise: float32 tensors of mean and std each times
        # 1/rescale_factor, made exactly as it makes them.
        channels = len(spec.image_mean)
        shape = (1, 1, channels, 1, 1)
        self.mean = (torch.tensor(spec.image_mean) * (1.0 / spec.rescale_factor)).view(shape)
        self.std = (torch.tensor(spec.image_std) * (1.0 / spec.rescale_factor)).view(shape)
        self.mean, self.std = self.mean.to(self.device), self.std.to(self.device)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (P, C*t*p*p), image_grid_thw (1, 3)) of an RGB image."""
        return self.encode(self.to_tensor(image))

    def to_tensor(self, image: Image.Image) -> torch.Tensor:
        """The image as a (3, H, W) uint8 tensor on this encoder's device: a channels-last view
        of its bytes, no channel-first copy (torch's uint8 resize is fastest on that layout)."""
        import numpy as np
        import torch

        if image.mode != "RGB":
            raise ValueError(f"expected an RGB image, got mode {image.mode}")
        hwc = torch.from_numpy(np.asarray(image))
        if self.device.type != "cpu":
            hwc = hwc.pin_memory().to(self.device, non_blocking=True)
        return hwc.permute(2, 0, 1)

    def encode(self, chw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw) of a (3, H, W) uint8 tensor, any strides."""
        import torch

        height, width = chw.shape[-2:]
        new_w, new_h = self.geometry.resized(int(width), int(height))
        resized = self.resize(chw, new_h, new_w)
        p = self.spec.patch_size
        gh, gw = new_h // p, new_w // p
        pixels = patchify(resized, p, self.spec.temporal_patch_size, self.mean, self.std)
        out = torch.empty(pixels.shape, dtype=self.dtype, device=self.device, pin_memory=self.pin)
        out.copy_(pixels)
        return out, torch.tensor([[1, gh, gw]], dtype=torch.long)

    def resize(self, chw: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Bicubic with antialias to (height, width), uint8 in and out, as the processor."""
        return resize_uint8(chw, height, width)


def resize_uint8(
    chw: torch.Tensor, height: int, width: int, *, native: bool | None = None
) -> torch.Tensor:
    """torchvision's uint8 bicubic resize as the processor calls it: native uint8 on the CPU,
    float32 then clamp and round elsewhere (`native=False` forces that path on the CPU, for the
    tests); the input itself when the size is unchanged."""
    import torch
    import torch.nn.functional as F

    if tuple(chw.shape[-2:]) == (height, width):
        return chw
    batch = chw.unsqueeze(0)
    if native is None:
        native = chw.device.type == "cpu"
    if native:
        out = F.interpolate(
            batch, size=(height, width), mode="bicubic", antialias=True, align_corners=False
        )
    else:
        out = F.interpolate(
            batch.float(), size=(height, width), mode="bicubic", antialias=True, align_corners=False
        )
        out = out.clamp_(0, 255).round_().to(torch.uint8)
    return out[0]


def patchify(
    chw: torch.Tensor,
    patch: int,
    temporal: int,
    mean: torch.Tensor,
    std: torch.Tensor,
) -> torch.Tensor:
    """Normalised float32 rows (gh * gw, C * temporal * patch * patch) in the processor's order.

    The uint8 image is viewed as (gh, gw, C, p, p) patches (no copy), converted to float32 in
    that order in one pass, then normalised in place: a subtraction then a division, the
    processor's own two float32 operations, so the values are bit-equal to its.
    """
    import torch

    channels, height, width = chw.shape
    gh, gw = height // patch, width // patch
    view = chw.unflatten(1, (gh, patch)).unflatten(3, (gw, patch)).permute(1, 3, 0, 2, 4)
    rows = torch.empty(view.shape, dtype=torch.float32, device=chw.device)
    rows.copy_(view)
    rows.sub_(mean).div_(std)
    if temporal != 1:  # the processor repeats each patch over time for a still image
        rows = rows.unsqueeze(3).expand(gh, gw, channels, temporal, patch, patch)
    return rows.reshape(gh * gw, channels * temporal * patch * patch)
