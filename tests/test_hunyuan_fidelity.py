"""HunyuanOCR's image-token numerics as the model was trained (ocrq/models/hunyuan/fidelity.py).

The references here are written from the training code's formulas, not taken from any library:
(a) XD-RoPE cos/sin per dimension on a small multi-row image grid, in both layouts, against what
ocrq's paths apply and what the model instance's own rotary module returns; (b) a hand-written
bilinear resampling of the ViT position table with the +0.1 scale factor; (c) a tiny-checkpoint
prefill whose logits move between the two modes by more than a stated bound, so reverting the
default fails; (d) the fast loop equals generate() in the transformers mode too (the default
mode is covered by tests/test_hunyuan_decode.py and tests/test_hunyuan_engine.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from ocrq.core.settings import Settings
from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.fidelity import axis_of_dim, rope_layout_of
from ocrq.models.hunyuan.generation import BatchOutput
from tests.tiny_hunyuan import cpu_settings, item, max_diff, mixed, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

MAX_NEW = 6
TOLERANCE = 1e-3  # fp32 fast loop vs generate(), as in tests/test_hunyuan_decode.py
# The two layouts must move the tiny model's first-step logits by far more than the paths'
# own noise: measured ~0.1-0.5 on these images, noise ~1e-5.
LAYOUT_BOUND = 20 * TOLERANCE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("fidelity"), "1.5")


def _engine(path: Path, **modes: Any) -> HunyuanEngine:
    eng = HunyuanEngine(cpu_settings(str(path), MAX_NEW, **modes), decode="fast")
    eng.load()
    return eng


@pytest.fixture(scope="module")
def trained(checkpoint: Path) -> HunyuanEngine:
    return _engine(checkpoint)


@pytest.fixture(scope="module")
def library(checkpoint: Path) -> HunyuanEngine:
    return _engine(checkpoint, hunyuan_rope="transformers", hunyuan_vit_positions="transformers")


def test_defaults_follow_the_training_code(trained: HunyuanEngine) -> None:
    settings = Settings()
    assert (settings.hunyuan_rope, settings.hunyuan_vit_positions) == ("trained", "trained")
    assert rope_layout_of(trained.model) == "trained"
    assert trained._decoder.text.rope_layout == "trained"


# -- (a) the RoPE layout -------------------------------------------------------------------------


def reference_axis(d: int, sections: list[int], layout: str) -> int:
    """The training code: sections repeated (eight chunks), chunk i from axis i % 4, i.e. the
    axis of the section holding frequency d mod D/2. transformers: each section doubled."""
    if layout == "trained":
        f, edge = d % sum(sections), 0
        for axis, width in enumerate(sections):
            edge += width
            if f < edge:
                return axis
    edge = 0
    for axis, width in enumerate(sections):
        edge += 2 * width
        if d < edge:
            return axis
    raise AssertionError(d)


def reference_cos_sin(
    positions: list[list[int]], inv_freq: list[float], sections: list[int], layout: str
) -> tuple[list[list[float]], list[list[float]]]:
    """cos/sin (tokens, D) for positions given per axis (axes, tokens)."""
    dim = 2 * len(inv_freq)
    cos, sin = [], []
    for t in range(len(positions[0])):
        angles = [
            positions[reference_axis(d, sections, layout)][t] * inv_freq[d % len(inv_freq)]
            for d in range(dim)
        ]
        cos.append([math.cos(a) for a in angles])
        sin.append([math.sin(a) for a in angles])
    return cos, sin


def grid_positions(rows: int, cols: int, start: int = 3) -> list[list[int]]:
    """Per-axis positions of text, then a rows x cols image (p, w, h, t), as the model numbers
    them: text tokens have all four equal; image tokens carry their column, row and image."""
    p, w, h, t = [], [], [], []
    for i in range(start):
        p.append(i), w.append(i), h.append(i), t.append(i)
    for r in range(rows):
        for c in range(cols):
            p.append(start + r * cols + c), w.append(c), h.append(r), t.append(0)
    return [p, w, h, t]


@pytest.mark.parametrize("layout", ["trained", "transformers"])
def test_axis_of_dim_matches_the_formula(layout: str) -> None:
    for sections in ([16, 16, 16, 16], [2, 2, 2, 2], [4, 8, 2, 2]):
        dim = 2 * sum(sections)
        want = [reference_axis(d, sections, layout) for d in range(dim)]
        assert axis_of_dim(sections, dim, layout) == want
    # The trained layout pairs dimension d with d + D/2 on one axis; transformers' does not.
    got = axis_of_dim([16, 16, 16, 16], 128, layout)
    paired = all(got[d] == got[d + 64] for d in range(64))
    assert paired == (layout == "trained")


@pytest.mark.parametrize("layout", ["trained", "transformers"])
def test_applied_cos_sin_equal_the_reference(
    layout: str, trained: HunyuanEngine, library: HunyuanEngine
) -> None:
    import torch

    engine = trained if layout == "trained" else library
    text = engine._decoder.text
    rotary = engine.model.model.language_model.rotary_emb
    sections = list(rotary.mrope_section)
    inv = rotary.inv_freq.float().tolist()
    pos = grid_positions(3, 5)
    want_cos, want_sin = reference_cos_sin(pos, inv, sections, layout)
    want_cos, want_sin = torch.tensor(want_cos), torch.tensor(want_sin)
    positions = torch.tensor(pos)
    # ocrq's paths (fused, packed and padded prefills, decode steps) all go through text.rope.
    cos, sin = text.rope(positions)
    assert torch.allclose(cos[:, 0], want_cos, atol=1e-5)
    assert torch.allclose(sin[:, 0], want_sin, atol=1e-5)
    # The model's own forward (generate(), the unfused prefill) uses the same layout.
    lib_cos, lib_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.allclose(lib_cos[0], want_cos, atol=1e-5)
    assert torch.allclose(lib_sin[0], want_sin, atol=1e-5)


def test_only_the_trained_layout_is_relative_on_image_tokens(
    trained: HunyuanEngine, library: HunyuanEngine
) -> None:
    """q.k of two image tokens must depend only on their offset: shifting both along the row
    axis by the same amount keeps it in the trained layout and changes it in transformers'."""
    import torch

    from ocrq.models.hunyuan.text import rotate

    gen = torch.Generator().manual_seed(0)
    dims = trained._decoder.text.head_dim
    q, k = torch.randn(dims, generator=gen), torch.randn(dims, generator=gen)

    def dot(engine: HunyuanEngine, a: list[int], b: list[int]) -> float:
        cos, sin = engine._decoder.text.rope(torch.tensor([a, b]).t())
        qa = rotate(q[None, None], cos[:1], sin[:1])
        kb = rotate(k[None, None], cos[1:], sin[1:])
        return float((qa * kb).sum())

    # (p, w, h, t) of two tokens of one image, then both moved two rows down.
    a, b = [10, 1, 2, 0], [14, 3, 5, 0]
    a2, b2 = [10, 1, 4, 0], [14, 3, 7, 0]
    assert dot(trained, a, b) == pytest.approx(dot(trained, a2, b2), abs=1e-4)
    assert abs(dot(library, a, b) - dot(library, a2, b2)) > 1e-2


# -- (b) the ViT position-table interpolation ---------------------------------------------------


def reference_bilinear(table: list[list[float]], out_h: int, out_w: int, scale_h: float,
                       scale_w: float) -> list[list[float]]:
    """Bilinear resampling, align_corners=False, as torch's CUDA kernel (where the model was
    trained) does it: output cell i reads source coordinate (i + 0.5) / scale - 0.5, clamped at
    0 below, its neighbours clamped to the edge; a same-size table is copied."""
    src_h, src_w = len(table), len(table[0])
    if (out_h, out_w) == (src_h, src_w):  # torch's kernels copy a table of the grid's size
        return [list(row) for row in table]

    def coord(i: int, scale: float, size: int) -> tuple[int, int, float]:
        x = max((i + 0.5) / scale - 0.5, 0.0)
        lo = min(math.floor(x), size - 1)
        hi = min(lo + 1, size - 1)
        return lo, hi, x - lo

    out = []
    for i in range(out_h):
        y0, y1, fy = coord(i, scale_h, src_h)
        row = []
        for j in range(out_w):
            x0, x1, fx = coord(j, scale_w, src_w)
            top = table[y0][x0] * (1 - fx) + table[y0][x1] * fx
            bottom = table[y1][x0] * (1 - fx) + table[y1][x1] * fx
            row.append(top * (1 - fy) + bottom * fy)
        out.append(row)
    return out


@pytest.mark.parametrize("mode", ["trained", "transformers"])
def test_vit_positions_equal_the_hand_written_bilinear(
    mode: str, trained: HunyuanEngine, library: HunyuanEngine
) -> None:
    import torch

    engine = trained if mode == "trained" else library
    embed = engine.model.model.vision_tower.embeddings
    edge, dim = embed.position_edge, embed.embed_dim
    table = embed.position_embedding.weight[1:, :].detach().reshape(edge, edge, dim).float()
    for h, w in ((6, 10), (edge - 3, 4), (edge, 10), (edge, edge)):
        got = embed.interpolate_pos_encoding(torch.zeros(1), h, w).reshape(h, w, dim)
        shift = 0.1 if mode == "trained" else 0.0
        for channel in (0, dim // 2, dim - 1):
            plane = table[:, :, channel].tolist()
            want = reference_bilinear(plane, h, w, (h + shift) / edge, (w + shift) / edge)
            assert torch.allclose(got[:, :, channel], torch.tensor(want), atol=1e-5), (h, w)


def test_the_two_interpolations_differ_off_the_native_grid(
    trained: HunyuanEngine, library: HunyuanEngine
) -> None:
    import torch

    a = trained.model.model.vision_tower.embeddings
    b = library.model.model.vision_tower.embeddings
    assert torch.equal(a.position_embedding.weight, b.position_embedding.weight)
    off = (a.interpolate_pos_encoding(torch.zeros(1), 6, 10)
           - b.interpolate_pos_encoding(torch.zeros(1), 6, 10)).abs().max()
    assert off > 1e-3


# -- (c) the effect on a prefill, and (d) both paths agree in either mode -----------------------


@pytest.fixture(scope="module")
def batch() -> list[Any]:
    return mixed(31)


@pytest.fixture(scope="module")
def trained_fast(trained: HunyuanEngine, batch: list[Any]) -> BatchOutput:
    return trained.generate(batch, output_logits=True, decode="fast")


@pytest.fixture(scope="module")
def library_fast(library: HunyuanEngine, batch: list[Any]) -> BatchOutput:
    return library.generate(batch, output_logits=True, decode="fast")


def test_the_modes_move_the_prefills_logits(
    trained_fast: BatchOutput, library_fast: BatchOutput
) -> None:
    moved = [max_diff(a, b, slice(0, 1)) for a, b in
             zip(trained_fast.items, library_fast.items, strict=True)]
    assert min(moved) > LAYOUT_BOUND, moved


def test_each_mode_moves_the_logits_on_its_own(checkpoint: Path, trained: HunyuanEngine) -> None:
    """Either difference alone changes the prefill: a half-reverted default is caught too."""
    image = [item(120, 88, 5)]
    ref = trained.generate(image, output_logits=True, decode="fast").items[0]
    for modes in ({"hunyuan_rope": "transformers"}, {"hunyuan_vit_positions": "transformers"}):
        other = _engine(checkpoint, **modes).generate(image, output_logits=True, decode="fast")
        assert max_diff(ref, other.items[0], slice(0, 1)) > LAYOUT_BOUND, modes


def test_fast_equals_generate_in_the_transformers_mode(
    library: HunyuanEngine, batch: list[Any], library_fast: BatchOutput
) -> None:
    plain = library.generate(batch, output_logits=True, decode="generate")
    for a, b in zip(plain.items, library_fast.items, strict=True):
        assert b.token_ids == a.token_ids
        assert max_diff(a, b) < TOLERANCE


def test_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        Settings(hunyuan_rope="vllm")
    with pytest.raises(ValueError, match="RoPE layout"):
        axis_of_dim([2, 2, 2, 2], 16, "vllm")  # type: ignore[arg-type]
