"""Bad inputs of every kind the issue names, written to a folder; expected error fragments."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

from ocrq.core.samples import draw_text_image


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A tiny PNG whose header claims width x height pixels: a decompression bomb's shape."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    body = struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    idat = zlib.compress(b"\x00" * 64)
    idat_chunk = b"IDAT" + idat
    body += struct.pack(">I", len(idat)) + idat_chunk + struct.pack(">I", zlib.crc32(idat_chunk))
    iend = b"IEND"
    body += struct.pack(">I", 0) + iend + struct.pack(">I", zlib.crc32(iend))
    return b"\x89PNG\r\n\x1a\n" + body


def write_bad_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, a fragment the job's error must contain)."""
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    draw_text_image(["TRUNCATED JPEG"] * 6).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    files = {
        "empty": (b"", "empty image"),
        "corrupt": (bytes(range(256)) * 40, "not an image"),
        "truncated": (jpeg[: len(jpeg) // 2], "corrupt or truncated"),
        # Plain text: bytes that start like a PDF are a document now, and a corrupt one fails as
        # "corrupt or unreadable PDF" (tests/test_documents.py).
        "notimage": (b"this is plain text, not a picture\n" * 20, "not an image"),
        "bomb": (png_bomb(), "decompression bomb"),
    }
    suffix = {
        "truncated": ".jpg",
        "corrupt": ".jpg",
        "bomb": ".png",
        "empty": ".png",
        "notimage": ".png",
    }
    out = {}
    for name, (data, fragment) in files.items():
        path = folder / f"bad-{name}{suffix[name]}"
        path.write_bytes(data)
        out[name] = (path, fragment)
    return out
