"""Sample images for the quick start, drawn here so the project ships no third-party data."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SAMPLES: dict[str, list[str]] = {
    "invoice.png": [
        "ACME SUPPLIES LTD",
        "INVOICE 2026-0142",
        "3 x PAPER A4 BOX      45.00",
        "1 x TONER BLACK       89.90",
        "TOTAL                134.90",
    ],
    "notice.png": [
        "The quick brown fox jumps",
        "over the lazy dog near",
        "the river bank at dawn.",
    ],
    "word.png": ["WELCOME"],
}


def draw_text_image(lines: list[str], size: int = 40, margin: int = 30) -> Image.Image:
    font = ImageFont.load_default(size=size)
    widths = [int(font.getlength(line)) for line in lines]
    line_h = int(size * 1.6)
    image = Image.new("RGB", (max(widths) + 2 * margin, line_h * len(lines) + 2 * margin), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((margin, margin + i * line_h), line, fill="black", font=font)
    return image


def write_samples(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, lines in SAMPLES.items():
        path = folder / name
        draw_text_image(lines, margin=4 if len(lines) == 1 else 30).save(path)
        paths.append(path)
    return paths
