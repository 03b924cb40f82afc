"""Chinese punctuation in Latin text folded to what a Latin-script reader expects.

The recogniser is a Chinese+English model: on English receipts it reads "(" as "（", ":" as
"：", a dash as "一" (the ideograph for one), in 11 of the 20 SROIE receipts. A regex for "(" or
"GST ID:" then misses, and a viewer without CJK fonts shows boxes.

A narrow map, not NFKC: NFKC folds the full-width forms (U+FF01-FF5E) the same way, but it also
rewrites what a Latin reader wants kept (m² to m2, ½ to 1⁄2, ligatures, ™ to TM), and it leaves
the ideographic punctuation (。、《》【】) and 一 alone. A character is folded only where the
letters or digits nearest it on either side, on its line, are not CJK (Han, kana, Hangul), and
the line holds some ASCII: in Chinese text, or a line of nothing else, it stays. 一 is the
numeral one as often as a misread dash, so the same rule keeps "一个" and a lone "一".
"""

from __future__ import annotations

# The full-width forms of ASCII ! to ~ are 0xFEE0 above it; the ideographic ones by hand.
FOLD: dict[str, str] = {chr(code + 0xFEE0): chr(code) for code in range(0x21, 0x7F)}
FOLD.update(
    {
        "\u3000": " ",  # ideographic space
        "。": ".",
        "、": ",",
        "《": "«",
        "》": "»",
        "【": "[",
        "】": "]",
        "一": "-",  # U+4E00, read for a dash
    }
)

_CJK_RANGES = (
    (0x1100, 0x11FF),  # Hangul jamo
    (0x3040, 0x30FF),  # hiragana, katakana
    (0x3100, 0x312F),  # bopomofo
    (0x3130, 0x318F),  # Hangul compatibility jamo
    (0x31F0, 0x31FF),  # katakana extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # Hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # half-width katakana
    (0x20000, 0x3134F),  # CJK extensions B-G
)


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def fold_latin(text: str) -> str:
    """`text` with FOLD applied where the surrounding text is Latin (see the module docstring).

    Works line by line: the text's lines are the engine's lines, each one reading of one row.
    """
    if not any(ch in FOLD for ch in text):
        return text
    return "\n".join(_fold_line(line) for line in text.split("\n"))


def _fold_line(line: str) -> str:
    if not any(ch in FOLD for ch in line) or not any(
        ch.isascii() and not ch.isspace() for ch in line
    ):
        return line
    # For each position, whether the nearest letter or digit before it (then after it) is CJK;
    # characters to fold are not letters here, so "一一" is judged by what lies around it.
    n = len(line)
    cjk_before = [False] * n
    cjk_after = [False] * n
    last = False
    for i, ch in enumerate(line):
        cjk_before[i] = last
        if ch.isalnum() and ch not in FOLD:
            last = is_cjk(ch)
    last = False
    for i in range(n - 1, -1, -1):
        ch = line[i]
        cjk_after[i] = last
        if ch.isalnum() and ch not in FOLD:
            last = is_cjk(ch)
    return "".join(
        FOLD[ch] if ch in FOLD and not (cjk_before[i] or cjk_after[i]) else ch
        for i, ch in enumerate(line)
    )
