"""Image intake on its own: each bad kind is refused with a clear ImageError."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from ocrq.core.contract import ImageRef
from ocrq.core.settings import Settings
from ocrq.intake import images
from tests.badfiles import write_bad_files


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    return Settings(allowed_roots=[tmp_path])


@pytest.mark.parametrize("kind", ["empty", "corrupt", "truncated", "notimage", "bomb"])
def test_bad_files_fail_with_clear_error(kind: str, tmp_path: Path, settings: Settings) -> None:
    path, fragment = write_bad_files(tmp_path)[kind]
    with pytest.raises(images.ImageError, match=fragment):
        images.load(ImageRef(path=str(path)), settings)


def test_path_outside_allowed_roots(settings: Settings, tmp_path: Path) -> None:
    outside = tmp_path.parent / "elsewhere.png"
    Image.new("RGB", (10, 10)).save(outside)
    with pytest.raises(images.ImageError, match="outside allowed roots"):
        images.load(ImageRef(path=str(outside)), settings)
    # A symlink inside the root pointing outside is outside too.
    link = tmp_path / "link.png"
    link.symlink_to(outside)
    with pytest.raises(images.ImageError, match="outside allowed roots"):
        images.load(ImageRef(path=str(link)), settings)


def test_missing_path_and_bad_b64_and_unreachable_url(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(images.ImageError, match="not found"):
        images.load(ImageRef(path=str(tmp_path / "nope.png")), settings)
    with pytest.raises(images.ImageError, match="invalid base64"):
        images.load(ImageRef(b64="@@not base64@@"), settings)
    # A worker's producer may skip the api: an empty image is said to be empty.
    with pytest.raises(images.ImageError, match=r"empty image: .* has 0 bytes"):
        images.load(ImageRef(b64="data:image/png;base64,"), settings)
    with pytest.raises(images.ImageError, match="unreachable"):
        images.load(
            ImageRef(url="http://127.0.0.1:9/x.png"),
            settings.model_copy(update={"url_timeout_s": 2.0}),
        )
    with pytest.raises(images.ImageError, match="scheme"):
        images.load(ImageRef(url="file:///etc/passwd"), settings)


def test_good_image_rgb_exif_rotated_and_downscaled(settings: Settings, tmp_path: Path) -> None:
    img = Image.new("L", (400, 100), 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    path = tmp_path / "rot.jpg"
    img.save(path, exif=exif)
    loaded = images.load(ImageRef(path=str(path)), settings, keep_pixels=10_000)
    assert loaded.original_size == (100, 400)  # EXIF applied
    assert loaded.image.mode == "RGB"
    w, h = loaded.image.size
    assert w * h <= 10_000 and abs(w / h - 0.25) < 0.05
    assert len(loaded.sha256) == 64


def test_inline_b64(settings: Settings) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (32, 16), "red").save(buf, "PNG")
    loaded = images.load(ImageRef(b64=base64.b64encode(buf.getvalue()).decode()), settings)
    assert loaded.original_size == (32, 16)


def test_byte_cap(tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (200, 200)).save(path)
    tight = Settings(allowed_roots=[tmp_path], max_image_bytes=100)
    with pytest.raises(images.ImageError, match="too large"):
        images.load(ImageRef(path=str(path)), tight)
