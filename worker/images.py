"""Image intake: fetch bytes from a path, URL or inline base64, check them, decode to RGB.

Every refusal is an ImageError with a message a user can act on; the caller fails that one job
and carries on. Checks run before the expensive step they guard: the byte cap before reading
everything, the pixel cap on the header before decoding (decompression bombs).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from ocrq.contract import ImageRef
from ocrq.settings import Settings

# We apply our own pixel cap to the header; Pillow's global check would fire on a warning-only
# path first and is process-wide state, so it is switched off in favour of ours.
Image.MAX_IMAGE_PIXELS = None


class ImageError(ValueError):
    """This image cannot be processed; the message says why."""


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # RGB, EXIF-rotated, possibly downscaled to max_pixels
    original_size: tuple[int, int]  # after EXIF rotation, before any downscale
    sha256: str
    source: str


def read_bytes(ref: ImageRef, settings: Settings) -> bytes:
    if ref.path:
        data = _read_path(ref.path, settings)
    elif ref.url:
        data = _read_url(ref.url, settings)
    else:
        data = _read_b64(ref.b64 or "", settings)
    if not data:
        raise ImageError(f"empty image: {ref.describe()} has 0 bytes")
    return data


def _read_path(raw: str, settings: Settings) -> bytes:
    path = Path(raw).expanduser()
    try:
        resolved = path.resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        raise ImageError(f"image not found: {raw}") from exc
    roots = settings.roots()
    if not any(resolved.is_relative_to(root) for root in roots):
        shown = ", ".join(str(r) for r in roots)
        raise ImageError(f"path outside allowed roots: {raw} (OCRQ_ALLOWED_ROOTS={shown})")
    if not resolved.is_file():
        raise ImageError(f"not a regular file: {raw}")
    size = resolved.stat().st_size
    if size > settings.max_image_bytes:
        raise ImageError(f"image too large: {size} bytes > limit {settings.max_image_bytes}")
    try:
        return resolved.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read {raw}: {exc.strerror or exc}") from exc


def _read_url(url: str, settings: Settings) -> bytes:
    if not url.startswith(("http://", "https://")):
        raise ImageError(f"unsupported URL scheme (http/https only): {url}")
    limit = settings.max_image_bytes
    try:
        with httpx.stream(
            "GET", url, timeout=settings.url_timeout_s, follow_redirects=True
        ) as response:
            if response.status_code != 200:
                raise ImageError(f"URL answered HTTP {response.status_code}: {url}")
            chunks: list[bytes] = []
            total = 0
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > limit:
                    raise ImageError(f"image too large: over {limit} bytes at {url}")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ImageError(f"URL unreachable: {url} ({type(exc).__name__}: {exc})") from exc
    return b"".join(chunks)


def _read_b64(text: str, settings: Settings) -> bytes:
    if len(text) * 3 // 4 > settings.max_image_bytes:
        raise ImageError(f"inline image too large: over {settings.max_image_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"invalid base64 image: {exc}") from exc


def decode(data: bytes, settings: Settings, source: str, max_pixels: int | None) -> LoadedImage:
    """Decode to RGB after checking the header's pixel count; downscale to `max_pixels`.

    Downscaling here, in the prefetch threads, keeps a waiting 35 MP receipt from holding
    100 MB while the device works, and spares the engine thread the resize.
    """
    digest = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > settings.max_image_pixels:
                raise ImageError(
                    f"image too large: {width}x{height} = {width * height} pixels > limit "
                    f"{settings.max_image_pixels} (possible decompression bomb)"
                )
            if width < 1 or height < 1:
                raise ImageError(f"image has no pixels: {width}x{height}")
            image.load()
            image = ImageOps.exif_transpose(image) or image
            rgb = image.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError(f"not an image (unrecognised format): {source}") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"corrupt or truncated image: {source} ({exc})") from exc
    original = rgb.size
    if max_pixels and original[0] * original[1] > max_pixels:
        rgb = downscale(rgb, max_pixels)
    return LoadedImage(image=rgb, original_size=original, sha256=digest, source=source)


def downscale(image: Image.Image, max_pixels: int) -> Image.Image:
    """Shrink keeping the aspect ratio so that w*h <= max_pixels."""
    w, h = image.size
    scale = (max_pixels / (w * h)) ** 0.5
    size = (max(1, int(w * scale)), max(1, int(h * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def load(ref: ImageRef, settings: Settings, max_pixels: int | None = None) -> LoadedImage:
    return decode(read_bytes(ref, settings), settings, ref.describe(), max_pixels)
