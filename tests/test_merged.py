"""Merged projections: the modules read the same weights through views, the merged GEMM gives
what the modules give, and merging twice does not copy again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ocrq.models.hunyuan.merged import merge_linears  # noqa: E402


def test_merged_weight_gives_what_the_modules_give() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(32, n, bias=False) for n in (64, 16, 16))
    x = torch.randn(5, 32)
    before = [m(x) for m in (q, k, v)]
    merged = merge_linears(q, k, v)
    assert merged is not None and merged.shape == (96, 32)
    assert q.weight.data_ptr() == merged.data_ptr()  # views, not copies
    assert k.weight.data_ptr() == merged[64:].data_ptr()
    for m, b in zip((q, k, v), before, strict=True):
        assert torch.equal(m(x), b)
    out = torch.nn.functional.linear(x, merged)
    assert torch.allclose(out, torch.cat(before, 1), atol=1e-6)
    with torch.no_grad():
        k.weight.mul_(2)  # the module's weight is the merged one's slice
    assert torch.equal(merged[64:80], k.weight)
    assert merge_linears(q, k, v) is merged  # a second decoder over the same model


def test_linears_that_cannot_share_a_weight_are_left_alone() -> None:
    a, b = torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 4, bias=True)
    weight = a.weight.data_ptr()
    assert merge_linears(a, b) is None and a.weight.data_ptr() == weight
    assert merge_linears(torch.nn.Linear(8, 4, bias=False),
                         torch.nn.Linear(6, 4, bias=False)) is None


def test_only_a_fused_decoder_merges(tmp_path) -> None:
    """The real engine load on a tiny checkpoint: the CPU engine never runs the fused step, so
    loading it leaves the modules' weights alone; a decoder that runs it merges at once."""
    from ocrq.models.hunyuan.decode import HunyuanDecoder
    from ocrq.models.hunyuan.engine import HunyuanEngine
    from tests.tiny_hunyuan import cpu_settings, tiny_checkpoint

    engine = HunyuanEngine(cpu_settings(str(tiny_checkpoint(tmp_path, "1.5")), 4), decode="fast")
    engine.load()
    text = engine._decoder.text
    attn = text.layers[0].self_attn
    separate = attn.q_proj.weight.data_ptr()
    assert text.qkv is None and getattr(attn.q_proj, "_ocrq_merged", None) is None
    fused = HunyuanDecoder(engine.model, attention="torch", fused=True)
    qkv, gate_up = fused.text.qkv, fused.text.gate_up
    assert qkv is not None and gate_up is not None and qkv[0] is not None
    assert gate_up[0] is not None
    assert attn.q_proj.weight.data_ptr() == qkv[0].data_ptr() != separate
    assert fused.text.merge()[0] is qkv  # once
