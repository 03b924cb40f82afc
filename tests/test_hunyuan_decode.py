"""The fast decode loop (ocrq/models/hunyuan/decode.py) against transformers' generate(), on the
CPU.

Both paths run on the same tiny random HunYuanVL and the same mixed-resolution, left-padded
batch; they must agree on token ids AND on every step's raw logits. The checks are shown to be
able to fail: a decode RoPE position off by one (the prefill is untouched, so step 0 still agrees)
moves later logits by orders of magnitude more than the tolerance. The Triton kernel is checked
against the torch reference in Triton's CPU interpreter, in a subprocess (the interpreter is
chosen when triton is first imported).

On the tiny 1.5 both loops apply its repetition penalty (1.08): they must agree on the scores
each token is chosen from too, and a loop that drops the penalty is caught by the same check.
The repetition guard is run on rows forced to loop (ocrq/testing/tiny_hunyuan.py, `ForcedLoop`):
both loops stop the same rows at the same length.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ocrq.core.settings import Settings
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.generation import BatchOutput, unsupported_reason
from ocrq.models.hunyuan.versions import RepetitionGuard
from tests.interpreter import interpret
from tests.tiny_hunyuan import (
    ShiftedDecoder,
    UnpenalisedDecoder,
    cpu_settings,
    item,
    max_diff,
    mixed,
    tiny_checkpoint,
)

pytestmark = pytest.mark.hunyuan

MAX_NEW = 12
# fp32 on the CPU: the two paths differ by ~5e-6 (sdpa with a bool mask and enable_gqa against
# transformers' float mask and repeat_kv); a wrong position moves logits by > 1.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HunyuanEngine:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    eng = HunyuanEngine(cpu_settings(str(path), MAX_NEW), decode="fast")
    eng.load()
    return eng


@pytest.fixture(scope="module")
def engine15(tmp_path_factory: pytest.TempPathFactory) -> HunyuanEngine:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt15"), "1.5")
    eng = HunyuanEngine(cpu_settings(str(path), MAX_NEW), decode="fast")
    eng.load()
    assert eng.version.name == "1.5" and eng.repetition_penalty == 1.08
    return eng


@pytest.fixture(scope="module")
def mixed_batch() -> list[PreparedImage]:
    return mixed(11)


@pytest.fixture(scope="module")
def plain(engine: HunyuanEngine, mixed_batch: list[PreparedImage]) -> BatchOutput:
    return engine.generate(mixed_batch, output_logits=True, decode="generate")


@pytest.fixture(scope="module")
def fast(engine: HunyuanEngine, mixed_batch: list[PreparedImage]) -> BatchOutput:
    return engine.generate(mixed_batch, output_logits=True, decode="fast")


@contextmanager
def eos_ids(engine: HunyuanEngine, ids: set[int]) -> Iterator[None]:
    """Treat `ids` as end-of-sequence tokens on both paths (the random model never emits the
    real eos, so finished rows are made by naming tokens it does emit): one assignment, since
    both loops read the engine's one SpecialTokens."""
    saved = engine.tokens
    assert saved is not None
    engine.tokens = dataclasses.replace(saved, eos=frozenset(ids))
    try:
        yield
    finally:
        engine.tokens = saved


def test_engine_uses_the_fast_loop(engine: HunyuanEngine, fast: BatchOutput) -> None:
    assert engine.describe()["decode"] == "fast"
    stats = engine.last_decode
    assert stats is not None and stats.steps == MAX_NEW - 1
    assert stats.attention == "torch" and not stats.graph  # CPU: eager steps, torch attention


def test_fast_equals_generate(plain: BatchOutput, fast: BatchOutput) -> None:
    assert fast.padded_length == plain.padded_length
    assert len({g.prompt_tokens for g in plain.items}) == len(plain.items)  # all padded apart
    for a, b in zip(plain.items, fast.items, strict=True):
        assert b.token_ids == a.token_ids
        assert b.text == a.text and b.capped == a.capped
        assert b.logits.shape == a.logits.shape == (MAX_NEW, 320)
        assert max_diff(a, b) < TOLERANCE


def test_wrong_rope_offset_is_caught(
    engine: HunyuanEngine,
    mixed_batch: list[PreparedImage],
    plain: BatchOutput,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shifted = ShiftedDecoder(engine.model, attention=engine._decoder.attention)
    with monkeypatch.context() as m:
        m.setattr(engine, "_decoder", shifted)
        broken = engine.generate(mixed_batch, output_logits=True, decode="fast")
    for a, b in zip(plain.items, broken.items, strict=True):
        assert max_diff(a, b, slice(0, 1)) < TOLERANCE  # the prefill does not use the offset
        assert max_diff(a, b, slice(1, None)) > 100 * TOLERANCE


def test_finished_rows_get_pad_and_the_loop_exits_early(
    engine: HunyuanEngine, mixed_batch: list[PreparedImage], plain: BatchOutput
) -> None:
    # Every row emits one of these by its third token, so all rows finish early, at different
    # steps; generate() stops there, the fast loop at its next all-finished check.
    stop = {g.token_ids[2] for g in plain.items}
    with eos_ids(engine, stop):
        want = engine.generate(mixed_batch, max_new_tokens=24, decode="generate")
        got = engine.generate(mixed_batch, max_new_tokens=24, decode="fast")
        assert engine.last_decode is not None and engine.last_decode.steps < 23
        banned = engine.generate(mixed_batch, max_new_tokens=9, min_new_tokens=6, decode="fast")
        banned_ref = engine.generate(
            mixed_batch, max_new_tokens=9, min_new_tokens=6, decode="generate"
        )
    for a, b in zip(want.items, got.items, strict=True):
        assert b.token_ids == a.token_ids and not a.capped and not b.capped
        assert len(a.token_ids) <= 2
    for a, b in zip(banned_ref.items, banned.items, strict=True):
        assert b.token_ids == a.token_ids and b.capped == a.capped
        assert len(b.token_ids) >= 6


def test_unsupported_generation_configs_take_generate() -> None:
    from transformers import GenerationConfig

    assert unsupported_reason(GenerationConfig(do_sample=False)) is None
    assert unsupported_reason(GenerationConfig(repetition_penalty=1.1)) is None  # both loops
    assert unsupported_reason(GenerationConfig(no_repeat_ngram_size=3)) == "no_repeat_ngram_size=3"
    assert unsupported_reason(GenerationConfig(do_sample=True)) == "sampling"
    assert unsupported_reason(GenerationConfig(num_beams=2)) == "beam search"


def test_decode_mode_comes_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OCRQ_DECODE", raising=False)
    assert Settings().decode == "fast" and HunyuanEngine(Settings()).decode == "fast"
    monkeypatch.setenv("OCRQ_DECODE", "generate")  # read once, into Settings
    settings = Settings()
    monkeypatch.delenv("OCRQ_DECODE")  # the engine never reads the environment itself
    assert HunyuanEngine(settings).decode == "generate"
    assert HunyuanEngine(settings, decode="fast").decode == "fast"
    monkeypatch.setenv("OCRQ_DECODE", "beam")
    with pytest.raises(ValueError, match="decode"):
        Settings()
    with pytest.raises(ValueError, match="decode"):
        HunyuanEngine(settings, decode="beam")


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import (
        HunYuanVLRMSNorm, apply_rotary_pos_emb)
    from ocrq.models.hunyuan.attention import KernelConfig, TritonDecodeAttention, attend_torch
    from ocrq.models.hunyuan.kernels import add_rms_norm, rope_rms_norm

    torch.manual_seed(0)
    B, H, KVH, D, L, END = 3, 8, 2, 32, 150, 121
    q, k, v = torch.randn(B, H, D), torch.randn(B, KVH, L, D), torch.randn(B, KVH, L, D)
    start = torch.tensor([0, 17, 60], dtype=torch.int32)
    end = torch.tensor([END], dtype=torch.int32)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        valid[b, int(start[b]):END] = True
    ref = attend_torch(q, k, v, valid, 0.3)
    configs = (KernelConfig(block_n=16, programs_per_sm=1), KernelConfig(block_n=16, exp2=False),
               KernelConfig(block_n=16))  # the last, exp2 (the default), for what follows
    for config in configs:
        attention = TritonDecodeAttention(B, H, KVH, D, L, "cpu", config, sm_count=4)
        out = attention(q, k, v, start, end, 0.3)
        print("splits", attention.splits, "diff", float((out - ref).abs().max()))
    unpadded = attention(q, k, v, torch.zeros_like(start), end, 0.3)  # ignores the padding
    print("ignoring padding", float((unpadded - ref).abs().max()))

    # Fused norms and RoPE against transformers' own modules (float32: the interpreter
    # truncates when it rounds to bfloat16, the GPU rounds to nearest like torch).
    norm = HunYuanVLRMSNorm(64, eps=1e-5)
    norm.weight.data = torch.randn(64) * 0.5 + 1
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    h, y = add_rms_norm(x, r, norm.weight, norm.variance_epsilon)
    print("add_rms_norm", float((h - (r + x)).abs().max() + (y - norm(r + x)).abs().max()))
    qn = HunYuanVLRMSNorm(D, eps=1e-5)
    qn.weight.data = torch.randn(D) * 0.5 + 1
    angle = (torch.arange(B).float()[:, None] * 7 + 3) / 10000 ** (torch.arange(0, D, 2) / D)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    rot, _ = apply_rotary_pos_emb(q[:, :, None], q[:, :, None], cos[:, None], sin[:, None])
    want = qn(rot)[:, :, 0]
    got = rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon)
    print("rope_rms_norm", float((got - want).abs().max()))
    kc, vc = torch.zeros(B, H, 10, D), torch.zeros(B, H, 10, D)
    vrow = torch.randn(B, H, D)
    rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon, cache=kc,
                  slot=torch.tensor([6]), v=vrow, v_cache=vc)
    untouched = float(kc[:, :, :6].abs().sum() + kc[:, :, 7:].abs().sum()
                      + vc[:, :, 7:].abs().sum())
    print("slot", float((kc[:, :, 6] - want).abs().max() + (vc[:, :, 6] - vrow).abs().max()
                        + untouched))

    # An fp8 pool (OCRQ_KV_CACHE_DTYPE=fp8): the kernel widens keys and values as it loads
    # them, as the reference does; the fused write saturates and rounds as `to_cache` does.
    from ocrq.models.hunyuan.kv_cache import to_cache
    fp8 = torch.float8_e4m3fn
    k8, v8 = to_cache(k, fp8), to_cache(v, fp8)
    ref8 = attend_torch(q, k8, v8, valid, 0.3)
    out8 = attention(q, k8, v8, start, end, 0.3)
    print("fp8 attention", float((out8 - ref8).abs().max()), float((ref8 - ref).abs().max()))
    qb = q.bfloat16()  # the GPU's case: bf16 queries, the fp8 pool multiplied in fp16
    half = attention(qb, k8, v8, start, end, 0.3).float()
    print("fp8 bf16", float((half - attend_torch(qb.float(), k8, v8, valid, 0.3)).abs().max()))
    kc8, vc8 = torch.zeros(B, H, 10, D, dtype=fp8), torch.zeros(B, H, 10, D, dtype=fp8)
    # Values fp8 holds exactly, and some beyond e4m3's 448 (saturated): the interpreter's own
    # fp32 -> fp8 rounding loses a carry into the exponent (1.94 -> 1.0; the GPU gives 2.0), so
    # only exact values can be compared bit for bit here; keys get a bound instead.
    vexact = to_cache(vrow * 100, fp8).float()
    vexact[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 500.0])
    rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon, cache=kc8,
                  slot=torch.tensor([6]), v=vexact, v_cache=vc8)
    print("fp8 slot", float((vc8[:, :, 6].float() - to_cache(vexact, fp8).float()).abs().max()),
          float(vc8.float().abs().max()),
          float(((kc8[:, :, 6].float() - want).abs() / want.abs().clamp(min=1e-2)).max()))

    # The running loop's pool: one pool expanded over the rows, each row its own [start, end),
    # values stored transposed, PAD_KEYS readable keys past the end; blocks load unmasked from
    # 16-key boundaries. Keys outside a row's range are NaN here: the scores mask must hold.
    from ocrq.models.hunyuan.attention import PAD_KEYS
    W = L + PAD_KEYS
    pool_k = torch.full((1, KVH, W, D), float("nan"))
    pool_k[:, :, :L] = k[0]
    pool_v = torch.zeros(1, KVH, D, W).transpose(2, 3)  # the loop's layout: (1, KVH, W, D) view
    pool_v[:, :, :L] = v[0]
    ends = torch.tensor([121, 90, 150], dtype=torch.int32)
    seen = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        seen[b, int(start[b]):int(ends[b])] = True
    shape = (B, KVH, W, D)
    ref_pool = attend_torch(q, k[:1].expand(B, -1, -1, -1), v[:1].expand(B, -1, -1, -1), seen,
                            0.3)
    # key ranges at fixed pool columns (before), then within each row (the default, last: the
    # fp8 check below reuses it)
    for config in (KernelConfig(block_n=16, programs_per_sm=1),
                   KernelConfig(block_n=32, row_splits=False), KernelConfig(block_n=32)):
        pooled = TritonDecodeAttention(B, H, KVH, D, L, "cpu", config, sm_count=4, padded=True)
        got = pooled(q, pool_k.expand(shape), pool_v.expand(shape), start, ends, 0.3)
        print("pool", pooled.splits, float((got - ref_pool).abs().max()))
    pool_k8 = to_cache(pool_k.nan_to_num(), fp8)
    pool_v8 = to_cache(pool_v, fp8)
    got8 = pooled(q, pool_k8.expand(shape), pool_v8.expand(shape), start, ends, 0.3)
    ref8_pool = attend_torch(q, pool_k8[:, :, :L].expand(B, -1, -1, -1),
                             pool_v8[:, :, :L].expand(B, -1, -1, -1), seen, 0.3)
    print("pool fp8", float((got8 - ref8_pool).abs().max()))
    # fp8 products (KernelConfig.fp8_products): queries and probabilities rounded to e4m3. The
    # interpreter's fp32 -> fp8 rounding loses carries (above), so the queries are ones e4m3
    # holds exactly and large enough that each row attends to few keys (probabilities near 0
    # or 1): what is left checks the plumbing (operands, P_SCALE), not the GPU's accuracy,
    # which bench/kv_attention.py --fp8-products reports. Relative to the output's scale, with
    # the widening kernel's distance from the same reference beside it.
    from dataclasses import replace
    qb = (q * 6).to(fp8).bfloat16()
    products = TritonDecodeAttention(B, H, KVH, D, L, "cpu", replace(config, fp8_products=True),
                                     sm_count=4, padded=True)
    args = (pool_k8.expand(shape), pool_v8.expand(shape), start, ends, 0.3)
    ref8_q = attend_torch(qb.float().to(fp8).float(), pool_k8[:, :, :L].expand(B, -1, -1, -1),
                          pool_v8[:, :, :L].expand(B, -1, -1, -1), seen, 0.3)
    scale8 = float(ref8_q.abs().max())
    print("pool fp8 products", float((products(qb, *args).float() - ref8_q).abs().max()) / scale8,
          float((pooled(qb, *args).float() - ref8_q).abs().max()) / scale8)
    vt = torch.zeros(B, H, D, 10).transpose(2, 3)  # a transposed value cache, written by slot
    rope_rms_norm(q, cos, sin, qn.weight, qn.variance_epsilon, cache=kc, slot=torch.tensor([3]),
                  v=vrow, v_cache=vt)
    print("slot transposed", float((vt[:, :, 3] - vrow).abs().max()
                                   + vt[:, :, :3].abs().sum() + vt[:, :, 4:].abs().sum()))

    # The decode step's greedy choice in one kernel against the torch path's scores: ties
    # across and within vocabulary blocks, penalised ids, banned and allowed eos.
    from ocrq.models.hunyuan.greedy import BLOCK, CHUNK, greedy_next, greedy_scores
    R, V = 6, CHUNK + BLOCK + 900
    logits = (torch.randn(R, V) * 3).to(torch.bfloat16)
    logits[0, 100] = logits[0, BLOCK + 5] = logits[0, CHUNK + 5] = 50  # the first wins
    logits[1, 7] = logits[1, 8] = 40
    logits[2, 9] = -60  # a penalised negative score
    seen = torch.rand(R, V) < 0.3
    seen[0] = False  # row 0's tie unpenalised
    eos = torch.tensor([3, CHUNK + 1])
    logits[3, CHUNK + 1] = 60  # banned below min_new: not chosen
    logits[4, 3] = 60  # allowed: chosen
    count, min_new = torch.tensor([5, 5, 5, 0, 9, 0]), torch.tensor([0, 0, 0, 4, 4, 0])
    for mask in (seen, None):
        want = greedy_scores(logits, mask, 1.05, count, min_new, eos).argmax(-1)
        got = greedy_next(logits, mask, 1.05, count, min_new, eos)
        print("greedy", int(torch.equal(got, want)), int(want[3] != CHUNK + 1),
              int(want[4] == 3), int(want[0] == 100))

    # The merged gate/up projections' activation against transformers' act_fn(gate) * up.
    from ocrq.models.hunyuan.kernels import silu_mul
    gu = torch.randn(5, 2 * 1500) * 4
    want = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
    print("silu_mul", float(((silu_mul(gu) - want).abs() / want.abs().clamp(min=1)).max()))
    """
)

ENGINE_CHECK = textwrap.dedent(
    """
    import sys
    import ocrq.models.hunyuan.prefill
    from ocrq.models.hunyuan import HunyuanLoopEngine
    from tests.test_hunyuan_decode import MAX_NEW
    from tests.tiny_hunyuan import cpu_settings, item

    engine = HunyuanLoopEngine(cpu_settings(sys.argv[1], MAX_NEW), decode="fast")
    engine.load()
    ocrq.models.hunyuan.prefill.PADDED_ROWS = 2  # the padded prefill's attention in two slices
    batch = [item(100, 150, 11), item(160, 90, 12, task="spotting"), item(64, 64, 13)]
    plain = engine.generate(batch, output_logits=True, decode="generate")
    fast = engine.generate(batch, output_logits=True, decode="fast")
    stats = engine.last_decode
    print("path", stats.attention, stats.fused)
    for a, b in zip(plain.items, fast.items, strict=True):
        print("row", int(a.token_ids == b.token_ids), float((a.logits - b.logits).abs().max()))
    even = [item(100, 150, 14), item(100, 150, 15)]  # no padding: the causal-only prefill
    plain = engine.generate(even, output_logits=True, decode="generate")
    fast = engine.generate(even, output_logits=True, decode="fast")
    for a, b in zip(plain.items, fast.items, strict=True):
        print("even", int(a.token_ids == b.token_ids), float((a.logits - b.logits).abs().max()))

    # The running loop's packed prefill with the fused kernels (the GPU's configuration)
    # against its padded one.
    from ocrq.models.hunyuan.loop_types import LoopRow
    from ocrq.models.hunyuan.running import RunningLoop
    from ocrq.models.slots import RunningBudget
    done = {}
    for packed in (False, True):
        config = engine.loop_config(RunningBudget(3, 1024, 4096, 0, 0, 0, 0),
                                    keep_logits=True, packed=packed)
        loop = RunningLoop(engine._decoder, engine.tokens, config)
        loop.add([LoopRow(it.key, engine.preprocess(it), 3, min_new_tokens=3) for it in batch])
        done[packed] = {d.row.key: d for d in loop.drain()}
    for key, a in done[False].items():
        b = done[True][key]
        print("packed", int(a.tokens == b.tokens), float((a.logits - b.logits).abs().max()))

    # An fp8 pool (values transposed, the kernel's padded loads) against the torch attention
    # reading the same pool.
    decoder = engine._decoder
    fp8 = {}
    for attention in ("triton", "torch"):
        decoder.attention = attention
        config = engine.loop_config(RunningBudget(3, 1024, 4096, 0, 0, 0, 0), keep_logits=True,
                                    packed=True, kv_dtype="fp8")
        loop = RunningLoop(decoder, engine.tokens, config)
        loop.add([LoopRow(it.key, engine.preprocess(it), 3, min_new_tokens=3) for it in batch])
        done = {d.row.key: d for d in loop.drain()}
        fp8[attention] = (done, loop.runner.tensors.values_transposed)
    decoder.attention = "triton"
    for key, a in fp8["triton"][0].items():
        b = fp8["torch"][0][key]
        print("fp8 loop", int(fp8["triton"][1]), int(a.tokens == b.tokens),
              float((a.logits - b.logits).abs().max()))
    """
)


@pytest.fixture(scope="module")
def interpreted(engine: HunyuanEngine) -> list[str]:
    """Both scripts in one interpreter process (importing torch and transformers is most of it)."""
    return interpret(KERNEL_CHECK + ENGINE_CHECK, str(engine.model_dir),
                     OCRQ_DECODE_ATTENTION="triton")


def test_triton_kernels_match_references_in_interpreter(interpreted: list[str]) -> None:
    lines = interpreted
    diffs = [(int(ln.split()[1]), float(ln.split()[3])) for ln in lines if ln.startswith("splits")]
    # one key range; three, the last empty for every row (merged by exp, then by exp2)
    assert [s for s, _ in diffs] == [1, 3, 3]
    assert all(d < 1e-5 for _, d in diffs), diffs
    names = ("ignoring", "add_rms_norm", "rope_rms_norm")
    value = {ln.split()[0]: float(ln.split()[-1]) for ln in lines if ln.startswith(names)}
    assert value["ignoring"] > 100 * 1e-5  # the check can fail
    assert value["add_rms_norm"] < 1e-5 and value["rope_rms_norm"] < 1e-5
    slot = next(float(ln.split()[-1]) for ln in lines if ln.startswith("slot"))
    assert slot < 1e-5
    kernel, fp8_vs_wide = (
        float(x) for x in next(ln for ln in lines if ln.startswith("fp8 attention")).split()[2:]
    )
    assert kernel < 1e-5 and fp8_vs_wide > 1e-4  # the same widened values; fp8 is not free
    bf16_queries = float(next(ln for ln in lines if ln.startswith("fp8 bf16")).split()[-1])
    assert bf16_queries < 2e-2  # bf16 queries and an fp16 product: a few roundings apart
    written, largest, key_error = (
        float(x) for x in next(ln for ln in lines if ln.startswith("fp8 slot")).split()[2:]
    )
    assert written == 0.0 and largest == 448.0 and key_error <= 0.5
    pool = [(int(ln.split()[1]), float(ln.split()[2])) for ln in lines if ln.startswith("pool ")
            and not ln.startswith("pool fp8")]
    assert [s for s, _ in pool] == [1, 2, 2] and all(d < 1e-5 for _, d in pool), pool
    pool_fp8 = float(next(ln for ln in lines if ln.startswith("pool fp8")).split()[-1])
    assert pool_fp8 < 1e-5
    products, widened = (float(x) for x in next(
        ln for ln in lines if ln.startswith("pool fp8 products")).split()[3:])
    # e4m3 probabilities cost ~1% here (a lost P_SCALE would be 256x off), and the result is
    # not the widening kernel's (the path ran)
    assert products < 2e-2 and widened < 1e-2 and products != widened, (products, widened)
    transposed = float(next(ln for ln in lines if ln.startswith("slot transposed")).split()[-1])
    assert transposed < 1e-6
    greedy = [ln.split()[1:] for ln in lines if ln.startswith("greedy")]
    assert greedy == [["1"] * 4] * 2, greedy
    silu = float(next(ln for ln in lines if ln.startswith("silu_mul")).split()[-1])
    assert silu < 1e-5


def test_triton_decode_path_equals_generate_in_interpreter(interpreted: list[str]) -> None:
    """The GPU configuration (Triton attention + fused kernels) on the CPU, end to end."""
    lines = interpreted
    assert "path triton True" in lines
    rows = [(int(ln.split()[1]), float(ln.split()[2])) for ln in lines if ln.startswith("row")]
    assert len(rows) == 3
    assert all(same == 1 and diff < TOLERANCE for same, diff in rows), rows
    even = [(int(ln.split()[1]), float(ln.split()[2])) for ln in lines if ln.startswith("even")]
    assert len(even) == 2
    assert all(same == 1 and diff < TOLERANCE for same, diff in even), even
    packed = [(int(ln.split()[1]), float(ln.split()[2])) for ln in lines
              if ln.startswith("packed")]
    assert len(packed) == 3
    assert all(same == 1 and diff < TOLERANCE for same, diff in packed), packed
    fp8 = [[float(x) for x in ln.split()[2:]] for ln in lines if ln.startswith("fp8 loop")]
    assert len(fp8) == 3
    assert all(transposed == 1 and same == 1 and diff < TOLERANCE
               for transposed, same, diff in fp8), fp8


def test_grouped_vision_attention_equals_the_per_image_loop(engine: HunyuanEngine) -> None:
    """Runs of equal-sized images share one sdpa call; features match the library's loop."""
    import torch

    from ocrq.models.hunyuan.patches import batch_vision_attention

    sizes = [(100, 150), (150, 100), (64, 64), (100, 150), (100, 150), (100, 150)]
    rows = [engine.preprocess(item(w, h, 20 + i)) for i, (w, h) in enumerate(sizes)]
    pixels = torch.cat([r.pixel_values for r in rows])
    grid = torch.cat([r.image_grid_thw for r in rows])
    model = engine.model.model
    calls = []
    handle = torch.nn.functional.scaled_dot_product_attention
    try:
        with torch.inference_mode():
            torch.nn.functional.scaled_dot_product_attention = (  # count calls
                lambda *a, **k: calls.append(1) or handle(*a, **k)
            )
            grouped = model.get_image_features(pixels, grid, return_dict=True).pooler_output
            n_grouped = len(calls)
            batch_vision_attention(engine.model, enabled=False)
            looped = model.get_image_features(pixels, grid, return_dict=True).pooler_output
    finally:
        torch.nn.functional.scaled_dot_product_attention = handle
        batch_vision_attention(engine.model, enabled=True)
    grouped = torch.cat(list(grouped)) if isinstance(grouped, (list, tuple)) else grouped
    looped = torch.cat(list(looped)) if isinstance(looped, (list, tuple)) else looped
    assert n_grouped == 3  # runs of 60, 16, 60 patches: 2, 1, 3 images (one layer here)
    assert float((grouped - looped).abs().max()) < 1e-5
    assert float(looped.abs().max()) > 1e-2


# --- repetition penalty -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain15(engine15: HunyuanEngine, mixed_batch: list[PreparedImage]) -> BatchOutput:
    return engine15.generate(mixed_batch, output_logits=True, decode="generate")


def scores_diff(a: Any, b: Any, pad: int, steps: slice = slice(None)) -> float:
    """Largest difference of two rows' scores over `steps`, the pad column left out: batched
    generate() also penalises the pad id in left-padded rows, the fast loop penalises each row's
    own tokens only, as a row alone is (ocrq/models/hunyuan/repetition.py)."""
    n = min(len(a.scores), len(b.scores))
    diff = (a.scores[:n][steps] - b.scores[:n][steps]).abs()
    diff[:, pad] = 0
    return float(diff.max())


def test_fast_equals_generate_with_the_penalty(
    engine15: HunyuanEngine, mixed_batch: list[PreparedImage], plain15: BatchOutput
) -> None:
    fast = engine15.generate(mixed_batch, output_logits=True, decode="fast")
    assert engine15.last_decode is not None and not engine15.last_decode.graph
    pad = engine15.tokens.pad
    for a, b in zip(plain15.items, fast.items, strict=True):
        assert b.token_ids == a.token_ids and b.truncated == a.truncated
        assert max_diff(a, b) < TOLERANCE
        assert scores_diff(a, b, pad) < TOLERANCE
        # The penalty is in the scores: every prompt token's score moved by 8%.
        assert float((a.scores[0] - a.logits[0]).abs().max()) > 100 * TOLERANCE


def test_a_dropped_penalty_is_caught(
    engine15: HunyuanEngine,
    mixed_batch: list[PreparedImage],
    plain15: BatchOutput,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Already the first token's scores differ (the prompt's tokens are penalised), by far more
    than the tolerance; and the tokens chosen differ in some row."""
    dropped = UnpenalisedDecoder(engine15.model, attention=engine15._decoder.attention)
    with monkeypatch.context() as m:
        m.setattr(engine15, "_decoder", dropped)
        broken = engine15.generate(mixed_batch, output_logits=True, decode="fast")
    pad = engine15.tokens.pad
    for a, b in zip(plain15.items, broken.items, strict=True):
        assert scores_diff(a, b, pad, slice(0, 1)) > 100 * TOLERANCE
    pairs = zip(plain15.items, broken.items, strict=True)
    assert any(a.token_ids != b.token_ids for a, b in pairs)


def test_penalty_is_transformers_processor() -> None:
    """`penalise` over a row's history is RepetitionPenaltyLogitsProcessor over that row's ids
    (duplicates and all); a left-padded row's history leaves the pad id out, so the row is
    penalised exactly as it is alone."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from ocrq.models.hunyuan.repetition import history_of, penalise

    torch.manual_seed(0)
    scores = torch.randn(3, 50) * 4
    ids = torch.randint(2, 50, (3, 12))
    ids[1, :4] = ids[1, 4]  # duplicates
    want = RepetitionPenaltyLogitsProcessor(1.08)(ids, scores.clone())
    assert torch.equal(penalise(scores, ids, 1.08), want)
    assert not torch.equal(want, scores)
    pad = 1
    padded = torch.cat([torch.full((3, 5), pad), ids], dim=1)
    mask = (padded != pad).long()
    history = history_of(padded, mask, mask.argmax(-1), new_tokens=4)
    assert history.shape == (3, 17 + 4)
    assert torch.equal(penalise(scores, history, 1.08), want)
    assert not torch.equal(penalise(scores, padded, 1.08), want)  # pad would be penalised


# --- repetition guard -------------------------------------------------------------------------

# A guard small enough for a CPU test: checks every 8 tokens, a loop of <= 8 tokens repeated 4
# times over 16+ tokens. The production guard's arithmetic is checked on its own below.
SMALL = RepetitionGuard(every=8, min_repeats=4, max_unit=8, min_span=16)
LOOP_START = 5


def forced(
    engine: HunyuanEngine, batch: list[PreparedImage], cycles: list[list[int]], **kwargs: Any
) -> BatchOutput:
    from ocrq.testing.tiny_hunyuan import ForcedLoop

    with ForcedLoop(engine.model, cycles, start=LOOP_START):
        return engine.generate(batch, **kwargs)


def test_guard_stops_a_forced_loop_on_both_paths(
    engine15: HunyuanEngine, mixed_batch: list[PreparedImage]
) -> None:
    """Row 0 loops on 3 tokens from its 6th: the guard stops it at the first check where the
    loop covers its span (max(4, 16/3 -> 6) x 3 = 18 tokens: 5 + 18 = 23 -> the check at 24).
    Row 1 cycles through 20 tokens, more than the guard's longest unit: never stopped. Both
    loops agree on every token and every reason."""
    batch = mixed_batch[:3]
    cycles = [[40, 41, 42], list(range(100, 120)), []]
    out = {
        mode: forced(engine15, batch, cycles, max_new_tokens=64, guard=SMALL, decode=mode)
        for mode in ("generate", "fast")
    }
    for a, b in zip(out["generate"].items, out["fast"].items, strict=True):
        assert a.token_ids == b.token_ids and a.truncated == b.truncated
    rows = out["fast"].items
    assert rows[0].truncated == "repetition" and len(rows[0].token_ids) == 24
    assert rows[0].token_ids[LOOP_START:] == ([40, 41, 42] * 7)[: 24 - LOOP_START]
    assert rows[1].truncated == "max_tokens" and len(rows[1].token_ids) == 64
    assert rows[1].token_ids[LOOP_START : LOOP_START + 20] == list(range(100, 120))
    # Without the guard the same row runs to the cap.
    unguarded = forced(engine15, batch, cycles, max_new_tokens=64, guard=False, decode="fast")
    assert unguarded.items[0].truncated == "max_tokens"
    assert len(unguarded.items[0].token_ids) == 64


def test_guard_ends_the_batch_early_and_waits_for_min_new_tokens(
    engine15: HunyuanEngine, mixed_batch: list[PreparedImage]
) -> None:
    """When every row loops, the fast loop stops stepping soon after the guard stopped them (at
    its next all-finished check); a forced length (min_new_tokens) is never cut."""
    batch = mixed_batch[:2]
    cycles = [[40, 41, 42], [7, 8]]
    out = forced(engine15, batch, cycles, max_new_tokens=96, guard=SMALL, decode="fast")
    assert [g.truncated for g in out.items] == ["repetition", "repetition"]
    assert engine15.last_decode is not None and engine15.last_decode.steps <= 32
    full = forced(
        engine15, batch, cycles, max_new_tokens=40, min_new_tokens=40, guard=SMALL, decode="fast"
    )
    assert [len(g.token_ids) for g in full.items] == [40, 40]
    assert [g.truncated for g in full.items] == ["max_tokens", "max_tokens"]


def test_a_stopped_row_is_done_with_one_copy_of_its_loop(
    engine15: HunyuanEngine, mixed_batch: list[PreparedImage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `run`: the looping row's result says `truncated="repetition"` and its text keeps
    one copy of the loop; the other row is untouched."""
    import dataclasses

    from ocrq.testing.tiny_hunyuan import ForcedLoop

    monkeypatch.setattr(engine15, "version", dataclasses.replace(engine15.version, guard=SMALL))
    settings = engine15.settings.model_copy(update={"max_new_tokens": 64})
    monkeypatch.setattr(engine15, "settings", settings)
    vocab = engine15.processor.tokenizer.get_vocab()
    a, b, c = vocab["a"], vocab["b"], vocab["c"]
    batch = mixed_batch[:2]
    with ForcedLoop(engine15.model, [[a, b, c], list(range(100, 120))], start=LOOP_START):
        results = engine15.run(batch)
    assert all(isinstance(r, OcrResult) for r in results)
    assert results[0].truncated == "repetition"
    assert results[0].text.endswith("abc") and "abcabc" not in results[0].text
    assert results[1].truncated == "max_tokens"


def test_production_guard_finds_loops_and_spares_short_runs() -> None:
    """The version's guard (8 copies, units up to 128 tokens, a 256-token span) on token rows:
    loops of 1, 5 and 128 tokens are found once they cover their span; the same loops just
    short of it, a 129-token unit, and text that merely repeats tokens are not."""
    import torch

    from ocrq.models.hunyuan.repetition import LoopFinder
    from ocrq.models.hunyuan.versions import V1_5

    guard = V1_5.guard
    assert guard.span(1) == 256 and guard.span(5) == 260 and guard.span(128) == 1024
    finder = LoopFinder(guard, "cpu")
    torch.manual_seed(1)

    def row(unit: int, copies: int, prefix: int = 300) -> list[int]:
        head = torch.randint(1000, 2000, (prefix,)).tolist()
        cycle = list(range(10, 10 + unit))
        return head + (cycle * copies)

    cases = [
        (row(1, 256), True),
        (row(1, 255), False),
        (row(5, 52), True),
        (row(5, 51), False),
        (row(128, 8), True),
        (row(128, 7), False),
        (row(129, 9), False),
        (torch.randint(10, 14, (1500,)).tolist(), False),  # four ids, no period
    ]
    width = max(len(r) for r, _ in cases)
    tokens = torch.tensor([[1] * (width - len(r)) + r for r, _ in cases])  # left-filled
    # Fill the short rows' heads with distinct ids so the filler cannot look like a loop.
    for i, (r, _) in enumerate(cases):
        tokens[i, : width - len(r)] = torch.arange(5000, 5000 + width - len(r))
    assert finder(tokens).tolist() == [want for _, want in cases]
    assert finder(tokens[:, :10]).tolist() == [False] * len(cases)  # fewer tokens than any span
