"""Image intake: fetch bytes from a path, URL or inline base64, check them, decode to RGB.

Every refusal is an ImageError with a message a user can act on; the caller fails that one job
and carries on. Checks run before the expensive step they guard: the byte cap before reading
everything; the format allowlist, the pixel cap, the side and aspect-ratio limits on the header
before decoding (decompression bombs, 1x100000 strips). URLs go through ocrq/intake/fetch.py's
policy; paths are opened once, beneath an allowed root.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from PIL import Image, ImageOps, UnidentifiedImageError

from ocrq.core.contract import ImageRef, b64_body, decode_b64_body
from ocrq.core.pixel_budget import scaled_size
from ocrq.core.settings import Settings
from ocrq.core.upload_paths import upload_folder_of

# We apply our own pixel cap to the header; Pillow's global check would fire on a warning-only
# path first and is process-wide state, so it is switched off in favour of ours.
Image.MAX_IMAGE_PIXELS = None


class ImageError(ValueError):
    """This image cannot be processed; the message says why."""


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # RGB, EXIF-rotated, possibly downscaled to the decode stage's pixels
    original_size: tuple[int, int]  # after EXIF rotation, before any downscale
    sha256: str
    source: str


def read_bytes(ref: ImageRef, settings: Settings) -> bytes:
    if ref.path:
        data = _read_path(ref.path, settings)
    elif ref.url:
        # Imported here: its HTTP client (httpx, and trio through httpcore) is ~0.5 s of a
        # start that never fetches a URL, the engine process's (issue 29).
        from ocrq.intake.fetch import FetchError, fetch

        try:
            data = fetch(ref.url, settings)
        except FetchError as exc:
            raise ImageError(str(exc)) from None
    else:
        data = _read_b64(ref.b64 or "", settings)
    if not data:
        raise ImageError(f"empty image: {ref.describe()} has 0 bytes")
    return data


def _read_path(raw: str, settings: Settings) -> bytes:
    with open_path(raw, settings) as fh:
        return read_capped(fh, raw, settings.max_image_bytes)


def open_path(raw: str, settings: Settings) -> BinaryIO:
    """A file under an allowed root, opened once and never through a symlink swapped in.

    The path is resolved (symlinks inside the roots are fine), then opened by walking down
    from the root one component at a time with O_NOFOLLOW, relative to the folder opened just
    before: a folder swapped for a symlink between the check and the read fails the walk
    instead of redirecting it. Its type comes from fstat of the very descriptor returned.
    Missing and outside-the-roots paths give the same message, so a job cannot probe the host.
    Documents are read through this too, lazily, page by page (ocrq/intake/documents.py).
    """
    hidden = ImageError(_not_found_message(raw, settings))
    try:
        resolved = Path(raw).expanduser().resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte
        raise hidden from None
    root = next((r for r in settings.roots() if resolved.is_relative_to(r)), None)
    if root is None:
        raise hidden
    parts = resolved.relative_to(root).parts
    if not parts:
        raise ImageError(f"not a regular file: {raw}")
    try:
        fd = _open_beneath(root, parts)
    except OSError:
        raise hidden from None
    # Checked on the bare descriptor: fdopen itself raises IsADirectoryError for a folder.
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageError(f"not a regular file: {raw}")
    return os.fdopen(fd, "rb")


def _not_found_message(raw: str, settings: Settings) -> str:
    """Why a path cannot be opened, without saying whether the file exists (a job must not
    probe the host). A path shaped like an api upload gets a message about OCRQ_UPLOAD_DIR:
    the api accepted it with 202, so the fix is on the worker's side, not the producer's."""
    folder = upload_folder_of(raw)
    if folder is None:
        return (
            f"image not found or outside allowed roots: {raw} (path images must be regular "
            "files under OCRQ_ALLOWED_ROOTS)"
        )
    if settings.upload_dir is None:
        return (
            f"uploaded image not readable on this worker: {raw}: OCRQ_UPLOAD_DIR is not set "
            f"here; set it to the api's upload folder ({folder}) on every worker, on a volume "
            "the api and the workers share"
        )
    mine = settings.upload_dir.expanduser().resolve()
    if Path(folder) != mine:
        return (
            f"uploaded image not readable on this worker: {raw}: it is in {folder}, but this "
            f"worker's OCRQ_UPLOAD_DIR is {mine}; the api and every worker need the same folder"
        )
    return (
        f"uploaded image not found in OCRQ_UPLOAD_DIR ({mine}): {raw}: is the api's upload "
        "volume mounted here, shared with the api at the same path?"
    )


def read_capped(fh: BinaryIO, raw: str, limit: int) -> bytes:
    """The rest of an opened file, refused when it is (or grows) larger than `limit`."""
    size = os.fstat(fh.fileno()).st_size
    if size > limit:
        raise ImageError(f"image too large: {size} bytes > limit {limit}")
    try:
        data = fh.read(limit + 1)
    except OSError as exc:
        raise ImageError(f"cannot read {raw}: {exc.strerror or exc}") from None
    if len(data) > limit:  # grew since fstat
        raise ImageError(f"image too large: over {limit} bytes")
    return data


def _open_beneath(root: Path, parts: tuple[str, ...]) -> int:
    """A read-only descriptor for root/parts..., no component a symlink (openat-style walk).

    O_NONBLOCK keeps a FIFO from blocking the open; its fstat then refuses it.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for name in parts[:-1]:
            child = os.open(name, flags | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
        final = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
        return os.open(parts[-1], flags | final, dir_fd=fd)
    finally:
        os.close(fd)


def _read_b64(text: str, settings: Settings) -> bytes:
    """Decode what producers commonly send (contract.b64_body says which forms); anything else
    is refused."""
    limit = settings.max_image_bytes
    too_large = ImageError(f"inline image too large: over {limit} bytes")
    if len(text) > 2 * (limit // 3 + 1) * 4 + 1024:  # cheap, before any copy: 2x for breaks
        raise too_large
    try:
        body = b64_body(text)
    except ValueError as exc:
        raise ImageError(str(exc)) from None
    if len(body) * 3 // 4 > limit:  # exact, still before decoding
        raise too_large
    try:
        return decode_b64_body(body)
    except ValueError as exc:
        raise ImageError(str(exc)) from None


def check_header(width: int, height: int, settings: Settings) -> None:
    """Refuse sizes that would cost too much, from the header alone (before any decoding)."""
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels: {width}x{height}")
    if width * height > settings.max_image_pixels:
        raise ImageError(
            f"image too large: {width}x{height} = {width * height} pixels > limit "
            f"{settings.max_image_pixels} (possible decompression bomb)"
        )
    if max(width, height) > settings.max_image_side:
        raise ImageError(
            f"image too large: {width}x{height}, a side over the limit of "
            f"{settings.max_image_side} pixels (OCRQ_MAX_IMAGE_SIDE)"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > settings.max_aspect_ratio:
        raise ImageError(
            f"image too elongated: {width}x{height}, aspect ratio {ratio:.0f} > limit "
            f"{settings.max_aspect_ratio:g} (OCRQ_MAX_ASPECT_RATIO)"
        )


def decode(data: bytes, settings: Settings, source: str, keep_pixels: int | None) -> LoadedImage:
    """Decode to RGB after checking the format and the header's size (the budget's
    `intake_limit`, OCRQ_MAX_IMAGE_PIXELS); downscale to `keep_pixels`, the budget's answer at
    its decode stage (ocrq/core/pixel_budget.py; None: keep).

    Downscaling here, in the prefetch threads, keeps a waiting 35 MP receipt from holding
    100 MB while the device works, and spares the engine thread the resize.
    """
    digest = hashlib.sha256(data).hexdigest()
    formats = settings.image_formats
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(io.BytesIO(data), formats=formats)
            except UnidentifiedImageError:
                known = sniff_format(data)
                if known and known not in formats:
                    raise ImageError(
                        f"unsupported image format: {known} in {source} (allowed: "
                        f"{', '.join(formats)}; OCRQ_IMAGE_FORMATS)"
                    ) from None
                raise
            check_header(*image.size, settings)
            image.load()
            image = ImageOps.exif_transpose(image) or image
            rgb = to_rgb(image)
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError(f"not an image (unrecognised format): {source}") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"corrupt or truncated image: {source} ({exc})") from exc
    original = rgb.size
    if keep_pixels and original[0] * original[1] > keep_pixels:
        rgb = downscale(rgb, keep_pixels)
    return LoadedImage(image=rgb, original_size=original, sha256=digest, source=source)


def sniff_format(data: bytes) -> str | None:
    """Which Pillow format's signature check accepts these bytes, without opening them: names
    a refused format in the error, and runs no parser of a format not allowed."""
    Image.init()
    prefix = data[:16]
    for name, (_factory, accept) in Image.OPEN.items():
        if accept is None:
            continue
        try:
            if accept(prefix):
                return name
        except Exception:  # a signature check that trips over a short prefix
            continue
    return None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with transparency composited on white: black text on a transparent background is
    black on white, not black on black (what a bare convert("RGB") gives)."""
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image.convert("RGB")


def downscale(image: Image.Image, pixels: int, floor: int = 0) -> Image.Image:
    """Shrink keeping the aspect ratio so that w*h <= pixels, never under `floor` (the model's:
    `scaled_size`); the image itself when it is within (never scaled up)."""
    size = scaled_size(image.size, pixels, floor)
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def load(ref: ImageRef, settings: Settings, keep_pixels: int | None = None) -> LoadedImage:
    return decode(read_bytes(ref, settings), settings, ref.describe(), keep_pixels)
