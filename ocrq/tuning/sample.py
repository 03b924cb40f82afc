"""The user's images `ocrq tune --images` sweeps with: read, de-duplicated, checked, sampled.

Why a sample of the user's own images: the sweet spot moves with what is read (a word crop ends
after a few tokens, a dense page after a thousand; the CPU engine's time follows the lines on a
page), so a recommendation made on drawn pages can be wrong for receipts. Why de-duplicate by
content: twenty copies of one scan say no more than one does, and a sweep over them would
pretend to a spread of sizes it never saw. The sample keeps the spread of sizes when the folder
is larger than the sample: images are sorted by pixels and taken evenly along that order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ocrq.core import procfs

SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".gif")
MIN_IMAGES = 3  # fewer distinct images than this cannot show a spread worth tuning on


class SampleProblem(ValueError):
    """The images given cannot support a recommendation (too few, all alike, unreadable)."""


@dataclass(frozen=True)
class SampleImage:
    """One distinct image of the sample, decoded to RGB."""

    name: str
    image: Image.Image

    @property
    def pixels(self) -> int:
        return self.image.width * self.image.height


@dataclass(frozen=True)
class UserSample:
    images: tuple[SampleImage, ...]
    found: int  # image files found under the paths given
    duplicates: int  # of those, copies of another one (same decoded pixels)
    unreadable: tuple[str, ...]  # files that were not images PIL could decode
    decoded_bytes_per_image: float  # host RSS growth per decoded image (input buffers)

    def describe(self) -> str:
        by_pixels = sorted(self.images, key=lambda s: s.pixels)
        sizes = [by_pixels[0].image.size, by_pixels[-1].image.size]
        extra = f", {self.duplicates} duplicates dropped" if self.duplicates else ""
        bad = f", {len(self.unreadable)} unreadable skipped" if self.unreadable else ""
        return (
            f"sample: {len(self.images)} of {self.found} images{extra}{bad}; sizes "
            f"{sizes[0][0]}x{sizes[0][1]} .. {sizes[-1][0]}x{sizes[-1][1]}"
        )


def image_files(paths: Sequence[Path]) -> list[Path]:
    """The image files among `paths`: files as given, folders searched recursively."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.suffix.lower() in SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise SampleProblem(f"{path}: no such file or folder")
    return found


def load_sample(paths: Sequence[Path], limit: int = 16) -> UserSample:
    """Decode the images under `paths`, drop copies and unreadable files, keep `limit` of them
    spread over their sizes; SampleProblem when fewer than MIN_IMAGES distinct ones remain."""
    files = image_files(paths)
    seen: set[str] = set()
    kept: list[SampleImage] = []
    unreadable: list[str] = []
    duplicates = 0
    before = procfs.rss_bytes()
    for path in files:
        try:
            with Image.open(path) as raw:
                image = raw.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            unreadable.append(str(path))
            continue
        digest = hashlib.sha256(image.tobytes()).hexdigest()
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        kept.append(SampleImage(path.name, image))
    grown = max(0, procfs.rss_bytes() - before)
    if len(kept) < MIN_IMAGES:
        why = (
            f"{len(files)} image files, {duplicates} of them copies of another"
            if duplicates
            else f"{len(files)} image files"
        )
        if unreadable:
            why += f", {len(unreadable)} unreadable"
        raise SampleProblem(
            f"too small a sample to tune on: {len(kept)} distinct images ({why}); give at least "
            f"{MIN_IMAGES} different images like the ones you will OCR (10-20 is better)"
        )
    per_image = grown / len(kept)
    kept.sort(key=lambda s: (s.pixels, s.name))
    if len(kept) > limit:
        step = (len(kept) - 1) / (limit - 1) if limit > 1 else 0
        kept = [kept[round(i * step)] for i in range(limit)]
    return UserSample(tuple(kept), len(files), duplicates, tuple(unreadable), per_image)
