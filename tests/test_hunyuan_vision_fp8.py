"""The vision tower's linears in fp8 (`OCRQ_VISION_GEMM_DTYPE=fp8`, models/hunyuan/vision_fp8.py).

torch runs `_scaled_mm` on the CPU with the same per-row and per-channel scales, so here the
real path runs: the quantisation's arithmetic, the products against their dequantised operands,
the merged q/k/v product and its views, the tiny model's tower and logits against its own
float32 path, `ocrq run` as a user starts it, and the Triton quantisation kernel under Triton's
CPU interpreter. bench/vision_fp8.py measures the time and the error on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ocrq.core.settings import Settings
from ocrq.models.hunyuan import HunyuanEngine
from tests.tiny_hunyuan import cpu_settings, item, mixed, rows, tiny_checkpoint

torch = pytest.importorskip("torch")

from ocrq.models.hunyuan.vision_fp8 import (  # noqa: E402
    FP8_MAX,
    Fp8Linear,
    fp8_unusable,
    fp8_vision_linears,
    quantize_rows_torch,
)

pytestmark = pytest.mark.hunyuan

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vision-fp8"), "1.5")


@pytest.fixture(scope="module")
def engines(checkpoint: Path) -> dict[str, HunyuanEngine]:
    out = {}
    for dtype in ("auto", "fp8"):
        eng = HunyuanEngine(cpu_settings(str(checkpoint), 3, vision_gemm_dtype=dtype),
                            decode="fast")
        eng.load()
        out[dtype] = eng
    return out


def test_rows_quantise_to_e4m3_with_their_own_scales() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 96, generator=gen) * torch.tensor([1e-3, 1.0, 50.0, 1.0, 7.0, 0.0])[:, None]
    q, scale = quantize_rows_torch(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    amax = x.abs().amax(dim=1)
    nonzero = amax > 0
    assert torch.equal(scale[nonzero, 0], amax[nonzero] / FP8_MAX)
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((5,), FP8_MAX))
    assert torch.equal(q[5].float(), torch.zeros(96))  # an all-zero row: zeros, not NaN
    # Each element within half an e4m3 step (at most 16 of 448 at the top binade) of its value.
    err = (q.float() * scale - x).abs()
    assert bool((err <= 16 * scale + 1e-12).all())
    assert float(err.max()) > 0  # rounding happened: the check can fail


def test_an_fp8_linear_is_the_product_of_its_dequantised_operands() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen) * torch.linspace(0.01, 3, 48)[:, None])
    x = torch.randn(3, 5, 64, generator=gen)
    fp8 = Fp8Linear.of(lin)
    with torch.inference_mode():
        out = fp8(x)
        qx, sx = quantize_rows_torch(x.reshape(-1, 64))
        want = (qx.float() * sx) @ (fp8.weight_q.float() * fp8.weight_scale.t()).t() + lin.bias
        exact = lin(x)
    assert out.shape == (3, 5, 48) and out.dtype == x.dtype
    assert rel(out.reshape(-1, 48), want) < 1e-5
    assert 1e-3 < rel(out, exact) < 0.08  # fp8 is not free, and not far off


def test_merged_q_k_v_share_one_weight_and_equal_their_own_products() -> None:
    gen = torch.Generator().manual_seed(3)
    lins = [torch.nn.Linear(32, 32) for _ in range(3)]
    whole, views = Fp8Linear.merged(lins)
    x = torch.randn(7, 32, generator=gen)
    with torch.inference_mode():
        together = whole(x).split(32, dim=-1)
        for lin, view, part in zip(lins, views, together, strict=True):
            assert torch.equal(view(x), part)
            assert torch.equal(view(x), Fp8Linear.of(lin)(x))
    start = whole.weight_q.data_ptr()
    assert [v.weight_q.data_ptr() - start for v in views] == [0, 32 * 32, 2 * 32 * 32]


def test_the_tower_and_logits_in_fp8_stay_near_the_models_dtype(
    engines: dict[str, HunyuanEngine],
) -> None:
    """The tiny model's six linears per vision layer swapped (q/k/v merged) and its features
    and first logits within fp8's rounding of the float32 path, through the grouped SDPA path
    and a varlen kernel (both start from `packed_qkv`)."""
    from ocrq.models.hunyuan.patches import batch_vision_attention
    from ocrq.models.hunyuan.vision_attention import reference_varlen

    base, fp8 = engines["auto"], engines["fp8"]
    assert (base.vision_gemm_dtype, fp8.vision_gemm_dtype) == ("float32", "fp8")
    assert fp8.describe()["vision_gemm_dtype"] == "fp8"
    for layer in fp8.model.model.vision_tower.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.ocrq_qkv, Fp8Linear)
        assert all(isinstance(m, Fp8Linear) for m in
                   (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.fc1, mlp.fc2))
    assert fp8_vision_linears(fp8.model) == 0  # swapped once
    assert not any(isinstance(m, Fp8Linear) for m in base.model.modules())
    assert not any(isinstance(m, Fp8Linear) for m in fp8.model.model.language_model.modules())

    encoded = rows(base, [*mixed(40), item(120, 200, 41)])

    def features(engine: HunyuanEngine) -> Any:
        pixels = torch.cat([r.pixel_values for r in encoded])
        grid = torch.cat([r.image_grid_thw for r in encoded])
        with torch.inference_mode():
            out = engine.model.model.get_image_features(pixels, grid, return_dict=True)
        out = out.pooler_output
        return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out

    want = features(base)
    grouped = features(fp8)
    try:
        batch_vision_attention(fp8.model, kernel=reference_varlen)
        varlen = features(fp8)
    finally:
        batch_vision_attention(fp8.model)
    assert 1e-4 < rel(grouped, want) < 0.1
    assert rel(varlen, grouped) < 1e-5  # the same products, another attention path

    batch = [*mixed(50), item(200, 120, 55)]
    a = base.generate(batch, output_logits=True, decode="fast", max_new_tokens=1)
    b = fp8.generate(batch, output_logits=True, decode="fast", max_new_tokens=1)
    for x, y in zip(a.items, b.items, strict=True):
        assert 0 < rel(y.logits[0], x.logits[0]) < 0.1


def test_fp8_says_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: torch.cuda is told which one it has (the only fake in this file)."""
    assert Settings().vision_gemm_dtype == "auto"
    assert fp8_unusable("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(8, 9)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability[0])
    assert "SM90 or later GPU, this one is SM89" in fp8_unusable("cuda:0")
    capability[0] = (9, 0)
    assert fp8_unusable("cuda:0") is None
    assert "NVIDIA GPU or the CPU" in fp8_unusable("meta")


def test_an_unknown_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("OCRQ_VISION_GEMM_DTYPE", "int8")
    with pytest.raises(ValidationError):
        Settings()


def test_ocrq_run_with_fp8_vision_gemms(checkpoint: Path, tmp_path: Path) -> None:
    """The way a user turns it on: the variable, `ocrq run`, the engine's log line says so."""
    from ocrq.core.samples import draw_text_image

    draw_text_image(["HELLO"]).save(tmp_path / "word.png")
    base = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    env = {**base, "OCRQ_MODEL": str(checkpoint), "OCRQ_MODEL_SUBFOLDER": "",
           "OCRQ_DEVICE": "cpu", "OCRQ_DTYPE": "float32", "OCRQ_MAX_NEW_TOKENS": "4",
           "OCRQ_VISION_GEMM_DTYPE": "fp8", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(BIN / "ocrq"), "run", "word.png", "--engine", "hunyuan", "--db", "run.sqlite",
         "-o", "out.jsonl", "--log-level", "INFO"],
        env=env, capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fp8 vision GEMMs" in done.stderr
    assert '"status": "done"' in (tmp_path / "out.jsonl").read_text()


KERNEL_CHECK = """
import torch
from ocrq.models.hunyuan.vision_fp8 import quantize_rows, quantize_rows_torch, use_kernel
gen = torch.Generator().manual_seed(4)
x = torch.randn(9, 300, generator=gen) * torch.linspace(0.01, 40, 9)[:, None]
x[4] = 0
x = x.to(torch.bfloat16)
wide = torch.zeros(9, 320, dtype=torch.bfloat16)
wide[:, :300] = x
for name, t in (("dense", x), ("strided", wide[:, :300])):
    assert use_kernel(t)
    (q, s), (qt, st) = quantize_rows(t), quantize_rows_torch(t)
    same = float((q.float() == qt.float()).float().mean())
    ratio = (q.float() / qt.float().where(qt.float() != 0, 1.0)).abs()
    ratio = ratio[(qt.float() != 0) & (q.float() != 0)]
    print(name, int(torch.equal(s, st)), same, float(ratio.min()), float(ratio.max()),
          int(torch.equal(q[4].float(), torch.zeros(300))), int(q.dtype == torch.float8_e4m3fn))
"""


def test_the_quantisation_kernel_in_the_interpreter() -> None:
    """Scales equal torch's to the bit; the e4m3 values agree except where the interpreter's
    own float8 rounding is coarse (it emulates the GPU's conversion in numpy and drops the carry
    of a rounding into the next binade: a factor of 2 at most). bench/vision_fp8.py checks the
    kernel against torch's arithmetic on the GPU, element for element."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True,
                         text=True, timeout=180, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {ln.split()[0]: ln.split()[1:] for ln in run.stdout.splitlines() if ln.strip()}
    for name in ("dense", "strided"):
        scales_equal, same, low, high, zero_row, is_fp8 = lines[name]
        assert scales_equal == "1" and zero_row == "1" and is_fp8 == "1"
        assert float(same) > 0.9
        assert float(low) >= 0.5 and float(high) <= 2.0
