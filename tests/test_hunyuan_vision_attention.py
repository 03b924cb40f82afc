"""The vision tower's attention kernel choice (ocrq/models/hunyuan/vision_attention.py).

FlashAttention-4 runs only on NVIDIA SM80/SM90/SM100 GPUs, so here (a CPU) the tests cover:
(a) the choice: "auto" keeps today's SDPA path, "fa4" fails to load with the reason, and each
reason `fa4_unusable` gives where a GPU is described to it; (b) the one-call varlen path that
"fa4" installs on each vision layer, with the torch reference kernel in FlashAttention-4's place:
the cumulative lengths and longest image it hands over, and the tower's features and the
prefill's logits against today's path; a kernel that ignores the bounds must fail the same
check. bench/vision_fa4.py runs the real kernel against today's path on a GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from ocrq.core.settings import Settings
from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.patches import batch_vision_attention
from ocrq.models.hunyuan.vision_attention import (
    choose,
    fa4_kernel,
    fa4_unusable,
    reference_varlen,
)
from tests.tiny_hunyuan import cpu_settings, item, max_diff, mixed, rows, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

TOLERANCE = 1e-4  # fp32: the same per-image attention, summed in another order at most


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("vision-attention"), "1.5")


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> HunyuanEngine:
    eng = HunyuanEngine(cpu_settings(str(checkpoint), 2), decode="fast")
    eng.load()
    return eng


class Recording:
    """The reference kernel, recording what each call was handed."""

    def __init__(self, ignore_bounds: bool = False) -> None:
        self.calls: list[tuple[list[int], int, int]] = []
        self.ignore_bounds = ignore_bounds

    def __call__(self, q: Any, k: Any, v: Any, cu_seqlens: Any, max_seqlen: int,
                 scale: float) -> Any:
        import torch

        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device
        self.calls.append((cu_seqlens.tolist(), max_seqlen, q.shape[0]))
        if self.ignore_bounds:  # every patch attends over the whole pass: images mix
            whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
            return reference_varlen(q, k, v, whole, q.shape[0], scale)
        return reference_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


def features(engine: HunyuanEngine, encoded: list[Any]) -> Any:
    """The vision tower over these rows as one pass, as the prefill calls it."""
    import torch

    inner = engine.model.model
    pixels = torch.cat([r.pixel_values for r in encoded])
    grid = torch.cat([r.image_grid_thw for r in encoded])
    with torch.inference_mode():
        out = inner.get_image_features(pixels, grid, return_dict=True).pooler_output
    return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out


def test_auto_keeps_sdpa_where_fa4_cannot_run(engine: HunyuanEngine) -> None:
    assert Settings().vision_attention == "auto"
    assert engine.vision_attention == "sdpa"
    attn = engine.model.model.vision_tower.layers[0].self_attn
    assert attn.forward.__func__.__name__ == "_grouped_vision_attention"
    assert choose("sdpa", "cuda:0", None, 72) == "sdpa"  # asked for: never looks further


def test_asking_for_fa4_where_it_cannot_run_fails_the_load(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OCRQ_VISION_ATTENTION", "fa4")
    settings = Settings(model=str(checkpoint), model_subfolder=None, device="cpu",
                        dtype="float32", max_new_tokens=2)
    assert settings.vision_attention == "fa4"
    with pytest.raises(RuntimeError, match="FlashAttention-4 cannot run: it needs an NVIDIA GPU"):
        HunyuanEngine(settings, decode="fast").load()


def test_an_unknown_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("OCRQ_VISION_ATTENTION", "flash")
    with pytest.raises(ValidationError):
        Settings()
    with pytest.raises(ValueError, match="auto, fa4 or sdpa"):
        choose("flash", "cpu", None, 72)


def test_the_reasons_fa4_gives_on_described_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: torch.cuda is told which one it has (the only fake in this file)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(7, 5)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability[0])
    assert "SM80/SM90/SM100 GPUs, this one is SM75" in fa4_unusable("cuda:0", torch.bfloat16, 72)
    capability[0] = (12, 0)
    assert "this one is SM120" in fa4_unusable("cuda:0", torch.bfloat16, 72)
    capability[0] = (9, 0)
    assert "float16 or bfloat16" in fa4_unusable("cuda:0", torch.float32, 72)
    assert "head size 76" in fa4_unusable("cuda:0", torch.bfloat16, 76)
    capability[0] = (10, 0)
    assert "head size 192" in fa4_unusable("cuda:0", torch.bfloat16, 192)
    capability[0] = (9, 0)
    installed = importlib.util.find_spec("flash_attn") is not None
    reason = fa4_unusable("cuda:0", torch.bfloat16, 72)
    if installed:  # the package imports: the GPU described is one it runs on
        assert reason is None and callable(fa4_kernel())
    else:  # the CPU test venv: the package is a separate extra
        assert "flash-attn-4 package is not importable" in reason and "ocrq[fa4]" in reason
        assert choose("auto", "cuda:0", torch.bfloat16, 72) == "sdpa"
        with pytest.raises(RuntimeError, match="not importable"):
            choose("fa4", "cuda:0", torch.bfloat16, 72)


def test_the_varlen_path_equals_todays_features(engine: HunyuanEngine) -> None:
    """Distinct sizes, a repeated size, one pass: the kernel is called once per layer with the
    pass's cumulative lengths and longest image, and the features equal today's."""
    encoded = rows(engine, [*mixed(70), item(64, 64, 80), item(120, 200, 81)])
    lengths = [int(r.image_grid_thw.prod()) for r in encoded]
    assert len(set(lengths)) >= 4
    edges = [0]
    for n in lengths:
        edges.append(edges[-1] + n)
    try:
        today = features(engine, encoded)
        kernel = Recording()
        batch_vision_attention(engine.model, kernel=kernel)
        varlen = features(engine, encoded)
        bad = Recording(ignore_bounds=True)
        batch_vision_attention(engine.model, kernel=bad)
        mixed_images = features(engine, encoded)
    finally:
        batch_vision_attention(engine.model)
    layers = len(engine.model.model.vision_tower.layers)
    assert kernel.calls == [(edges, max(lengths), edges[-1])] * layers
    assert float((varlen - today).abs().max()) < TOLERANCE
    assert float((mixed_images - today).abs().max()) > 100 * TOLERANCE  # the check can fail


def test_the_varlen_path_equals_todays_logits(engine: HunyuanEngine) -> None:
    """The prefill's last-position logits of a padded static batch of distinct images."""
    batch = [*mixed(90), item(200, 120, 95)]
    try:
        today = engine.generate(batch, output_logits=True, decode="fast", max_new_tokens=2)
        batch_vision_attention(engine.model, kernel=Recording())
        varlen = engine.generate(batch, output_logits=True, decode="fast", max_new_tokens=2)
    finally:
        batch_vision_attention(engine.model)
    for a, b in zip(today.items, varlen.items, strict=True):
        assert a.token_ids == b.token_ids
        assert max_diff(a, b) < TOLERANCE


def test_the_varlen_path_refuses_bounds_that_miss_the_pass(engine: HunyuanEngine) -> None:
    import torch

    attn = engine.model.model.vision_tower.layers[0].self_attn
    from ocrq.models.hunyuan.vision_attention import varlen_forward

    hidden = torch.randn(1, 10, attn.q_proj.in_features)
    with pytest.raises(ValueError, match="do not cover 10 patches"):
        varlen_forward(attn, hidden, torch.tensor([0, 4, 8]), kernel=reference_varlen)


# -- the packed text prefill's causal attention (`Settings.prefill_attention`) -----------------


class CausalRecording:
    """The causal reference, recording the heads and bounds each call was handed."""

    def __init__(self, causal: bool = True) -> None:
        self.calls: list[tuple[list[int], int, int, int]] = []
        self.causal = causal

    def __call__(self, q: Any, k: Any, v: Any, cu_seqlens: Any, max_seqlen: int,
                 scale: float) -> Any:
        self.calls.append((cu_seqlens.tolist(), max_seqlen, q.shape[1], k.shape[1]))
        return reference_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal=self.causal)


def test_prefill_attention_auto_keeps_torch_where_fa4_cannot_run(
    engine: HunyuanEngine, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings().prefill_attention == "auto"
    assert engine.prefill_attention == "sdpa"
    assert engine._decoder.text.causal_kernel is None
    monkeypatch.setenv("OCRQ_PREFILL_ATTENTION", "fa4")
    settings = Settings(model=str(checkpoint), model_subfolder=None, device="cpu",
                        dtype="float32", max_new_tokens=2)
    with pytest.raises(RuntimeError, match="prefill_attention=fa4, but FlashAttention-4 cannot"):
        HunyuanEngine(settings, decode="fast").load()


def test_the_packed_prefill_through_a_varlen_kernel_equals_todays(engine: HunyuanEngine) -> None:
    """The kernel gets the grouped key/value heads (not repeated) and the pass's bounds once a
    layer; the keys, values and logits equal torch's path. A kernel that is not causal differs
    (the check can fail)."""
    import torch

    from ocrq.models.hunyuan.packed import pack, prefill_packed

    text = engine._decoder.text
    encoded = rows(engine, [*mixed(120), item(64, 64, 130)])
    batch = pack(encoded, engine.model.model.config.image_token_id, text.device, text.dtype)
    fused = engine._decoder.fused

    def run(kernel: Any) -> tuple[Any, Any]:
        text.causal_kernel = kernel
        try:
            with torch.inference_mode():
                return prefill_packed(text, batch, fused)
        finally:
            text.causal_kernel = None

    (today_kv, today_logits), kernel = run(None), CausalRecording()
    kv, logits = run(kernel)
    _, wrong = run(CausalRecording(causal=False))
    assert kernel.calls == [(batch.edges, batch.longest, text.heads, text.kv_heads)] * len(
        text.layers
    )
    assert text.kv_heads < text.heads  # grouped: the kernel saw fewer key/value heads
    assert float((logits - today_logits).abs().max()) < TOLERANCE
    for (k, v), (k0, v0) in zip(kv, today_kv, strict=True):
        assert float((k - k0).abs().max()) < TOLERANCE and float((v - v0).abs().max()) < TOLERANCE
    assert float((wrong - today_logits).abs().max()) > 100 * TOLERANCE
