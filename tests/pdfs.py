"""Documents the tests make: image PDFs, PDFs with a text layer, multi-page TIFFs, and bad ones.

Image PDFs hold each page's pixels losslessly (PDFium's own encoder, Flate) on a page sized so
that rendering it at `dpi` gives back exactly those pixels: a document's page text can then be
compared with the same image's text, job for job. Text PDFs are written by hand (a standard
Helvetica font, one text object per line), the smallest file a real PDF reader accepts.
"""

from __future__ import annotations

import io
import random
import zlib
from collections.abc import Sequence
from pathlib import Path

import pypdfium2 as pdfium
from PIL import Image

TEST_DPI = 144  # points x 2: page sizes and the render scale are exact in binary


def image_pdf(pages: Sequence[Image.Image], path: Path, dpi: float = TEST_DPI) -> Path:
    pdf = pdfium.PdfDocument.new()
    try:
        for image in pages:
            rgb = image.convert("RGB")
            w, h = rgb.size[0] * 72 / dpi, rgb.size[1] * 72 / dpi
            page = pdf.new_page(w, h)
            obj = pdfium.PdfImage.new(pdf)
            obj.set_bitmap(pdfium.PdfBitmap.from_pil(rgb))
            obj.set_matrix(pdfium.PdfMatrix().scale(w, h))
            page.insert_obj(obj)
            page.gen_content()
            page.close()
        pdf.save(str(path))
    finally:
        pdf.close()
    return path


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def text_pdf(
    pages: Sequence[Sequence[str]],
    path: Path | None = None,
    size: tuple[float, float] = (420, 300),
    font_size: float = 20,
    extra_trailer: str = "",
    encrypt: bytes | None = None,
    sizes: dict[int, tuple[float, float]] | None = None,
) -> bytes:
    """A PDF whose pages hold `pages`' lines as real text (a text layer), Helvetica; `sizes`
    gives some pages (0-based) another size in points."""
    objects: list[bytes] = []
    n = len(pages)
    # 1 catalog, 2 pages, 3 font, then per page: page object, content stream.
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, lines in enumerate(pages):
        w, h = (sizes or {}).get(i, size)
        stream = f"BT /F1 {font_size} Tf {font_size * 1.6} TL 30 {h - 30 - font_size} Td "
        stream += " ".join(f"({_escape(line)}) Tj T*" for line in lines) + " ET"
        data = zlib.compress(stream.encode("latin-1"))
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {w} {h}] /Contents {5 + 2 * i} 0 R "
            "/Resources << /Font << /F1 3 0 R >> >> >>".encode()
        )
        objects.append(
            f"<< /Length {len(data)} /Filter /FlateDecode >>\nstream\n".encode()
            + data
            + b"\nendstream"
        )
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(f"{number} 0 obj\n".encode() + body + b"\nendobj\n")
    if encrypt is not None:
        offsets.append(out.tell())
        out.write(f"{len(objects) + 1} 0 obj\n".encode() + encrypt + b"\nendobj\n")
    xref = out.tell()
    count = len(offsets) + 1
    out.write(f"xref\n0 {count}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        out.write(f"{offset:010d} 00000 n \n".encode())
    trailer = f"<< /Size {count} /Root 1 0 R {extra_trailer}"
    if encrypt is not None:
        trailer += f" /Encrypt {len(objects) + 1} 0 R /ID [<00112233445566778899aabbccddeeff>"
        trailer += " <00112233445566778899aabbccddeeff>]"
    out.write(f"trailer\n{trailer} >>\nstartxref\n{xref}\n%%EOF\n".encode())
    data = out.getvalue()
    if path is not None:
        path.write_bytes(data)
    return data


def encrypted_pdf(path: Path) -> Path:
    """A PDF protected by a user password (RC4 40-bit standard handler): PDFium refuses to
    open it without the password, as it must."""
    # /O and /U are the standard security handler's entries; with a user password set and
    # not given, any 32-byte /U that is not the empty password's makes the open fail.
    encrypt = (
        b"<< /Filter /Standard /V 1 /R 2 /Length 40 /P -44 "
        b"/O <" + b"6b" * 32 + b"> /U <" + b"5a" * 32 + b"> >>"
    )
    path.write_bytes(text_pdf([["SECRET"]], encrypt=encrypt))
    return path


def multipage_tiff(pages: Sequence[Image.Image], path: Path) -> Path:
    first, *rest = [p.convert("RGB") for p in pages]
    first.save(path, format="TIFF", save_all=True, append_images=rest, compression="tiff_lzw")
    return path


def _assemble(objects: list[bytes]) -> bytes:
    """Numbered objects (1 is the catalog) into a PDF with a correct cross-reference table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(f"{number} 0 obj\n".encode() + body + b"\nendobj\n")
    xref = out.tell()
    out.write(f"xref\n0 {len(offsets) + 1}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        out.write(f"{offset:010d} 00000 n \n".encode())
    out.write(
        f"trailer\n<< /Size {len(offsets) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return out.getvalue()


def _stream(content: bytes, extra: str = "") -> bytes:
    data = zlib.compress(content, 9)
    head = f"<< {extra} /Length {len(data)} /Filter /FlateDecode >>\nstream\n".encode()
    return head + data + b"\nendstream"


def _one_page(content_object: int, resources: str, size: tuple[float, float]) -> list[bytes]:
    return [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {size[0]} {size[1]}] "
        f"/Contents {content_object} 0 R /Resources {resources} >>".encode(),
    ]


def xobject_bomb_pdf(
    path: Path, depth: int = 7, fanout: int = 10, size: tuple[float, float] = (420, 300)
) -> Path:
    """One page whose content draws Form XObject X{depth}, which draws X{depth-1} `fanout`
    times, ... down to X0, one stroked line: fanout**depth paths from ~2 KB (issue 31's bomb:
    10^7 paths, GBs of PDFium memory)."""
    # 1-3 catalog, pages, page; 4 the page content; 5 + k the XObject X{k}.
    objects = _one_page(4, f"<< /XObject << /X{depth} {5 + depth} 0 R >> >>", size)
    objects.append(_stream(f"q /X{depth} Do Q".encode()))
    for k in range(depth + 1):
        if k == 0:
            body, resources = b"0 0 m 400 280 l 20 280 l h S", "<< >>"
        else:
            body = (f"q /X{k - 1} Do Q " * fanout).encode()
            resources = f"<< /XObject << /X{k - 1} {5 + k - 1} 0 R >> >>"
        extra = f"/Type /XObject /Subtype /Form /BBox [0 0 {size[0]} {size[1]}] "
        objects.append(_stream(body, extra + f"/Resources {resources}"))
    path.write_bytes(_assemble(objects))
    return path


def line_ops_pdf(
    path: Path, lines: int = 3_000_000, size: tuple[float, float] = (420, 300)
) -> Path:
    """One page of `lines` stroked line segments (issue 31: 3,000,000 of them, ~146 KB
    compressed, drew for minutes at 99% CPU)."""
    w, h = size
    ops = b"".join(
        f"{i % 400} {i % 280} m {(i * 7) % 420} {(i * 13) % 300} l S\n".encode()
        for i in range(1000)
    )
    content = ops * (lines // 1000)
    objects = _one_page(4, "<< >>", (w, h))
    objects.append(_stream(content))
    path.write_bytes(_assemble(objects))
    return path


def shared_image_pdf(
    pages: int, image_bytes: int = 1_000_000, size: tuple[float, float] = (300, 100)
) -> bytes:
    """`pages` pages, page n reading `PAGE n`, each drawing one image XObject that all pages
    share (issue 52: `image_bytes` of noise, incompressible, drawn 12 pt wide in a corner): the
    file weighs about the image once, a one-page copy of any page weighs the image too."""
    side = int(image_bytes**0.5)
    noise = random.Random(52).randbytes(side * side)
    # 1 catalog, 2 pages, 3 font, 4 the image, then per page: page object, content stream.
    kids = " ".join(f"{5 + 2 * i} 0 R" for i in range(pages))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        f"<< /Type /XObject /Subtype /Image /Width {side} /Height {side} /ColorSpace /DeviceGray "
        f"/BitsPerComponent 8 /Length {len(noise)} >>\nstream\n".encode()
        + noise
        + b"\nendstream",
    ]
    w, h = size
    for n in range(1, pages + 1):
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {w} {h}] /Contents {6 + 2 * (n - 1)} "
            "0 R /Resources << /Font << /F1 3 0 R >> /XObject << /Im 4 0 R >> >> >>".encode()
        )
        content = f"q 12 0 0 12 {w - 16} 4 cm /Im Do Q BT /F1 24 Tf 20 40 Td (PAGE {n}) Tj ET"
        objects.append(_stream(content.encode()))
    return _assemble(objects)
