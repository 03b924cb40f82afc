"""Lab levers: settings for experiments and benches, apart from what an operator sets.

Each lever's default is the choice measurements made (the comment above it says which, where
one did); its other values are there to measure against that default, to reproduce another
implementation's numbers, or to try an idea on a new card. A deployment needs none of them,
and docs/settings.md lists them in a section of their own, after every operator's setting.
Their `OCRQ_*` names are the ones they had among the operator's groups: the benches, and any
deployment that already sets one, keep working.

HunyuanOCR's own engine reads its levers from its own group (`HunyuanSettings` inherits
`HunyuanLabSettings`); `LabSettings` is every lever, `settings.lab`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ocrq.core.settings_group import SettingsGroup

# HunyuanOCR's generation loop: ocrq's own (ocrq/models/hunyuan/decode.py) or transformers'
# generate().
DecodeMode = Literal["fast", "generate"]
# The fast loop's decode attention: Triton on CUDA when installed ("auto"), or forced.
DecodeAttention = Literal["auto", "triton", "torch"]
KvCacheDtype = Literal["auto", "fp8"]
VisionGemmDtype = Literal["auto", "fp8"]
# The vision tower's attention: FlashAttention-4 where usable ("auto"), or forced
# (ocrq/models/hunyuan/vision_attention.py).
VisionAttention = Literal["auto", "fa4", "sdpa"]
PreprocessMode = Literal["tensor", "processor"]
# When the running loop prefills waiting rows (ocrq/models/hunyuan/running.py says how each goes).
PrefillSchedule = Literal["alternate", "chunked"]
# Where HunyuanOCR's image-token numerics follow the code the model was trained with ("trained")
# or transformers' HunYuanVL ("transformers"); ocrq/models/hunyuan/fidelity.py says how they differ.
HunyuanNumerics = Literal["trained", "transformers"]


class HunyuanLabSettings(SettingsGroup):
    """HunyuanOCR's own engine's lab levers (OCRQ_ENGINE=hunyuan): its kernels and numerics,
    the running loop's prefill schedule and the interactive lane's inner limits. Inherited by
    `HunyuanSettings`, so the engine, built from its own group only, still reads them."""

    # HunyuanOCR's kernels and numerics (OCRQ_ENGINE=hunyuan).
    # HunyuanOCR's attention implementation; "eager" is refused (13 GiB for one A4 page).
    attention: str = "sdpa"
    # HunyuanOCR's XD-RoPE layout for image tokens and its ViT position-table interpolation:
    # Tencent's training code by default; "transformers" reproduces transformers' (and vLLM's)
    # outputs. Text tokens and decode steps are the same either way.
    hunyuan_rope: HunyuanNumerics = "trained"
    hunyuan_vit_positions: HunyuanNumerics = "trained"
    # Which loop generates: "fast" (ocrq's, CUDA graphs and Triton kernels; same greedy tokens)
    # or "generate" (transformers'). Part of a tuned profile's key: each holds other memory.
    decode: DecodeMode = "fast"
    # The fast loop's decode attention; "torch" also turns the fused norm/RoPE kernels off.
    decode_attention: DecodeAttention = "auto"
    # The vision tower's attention: "auto" is FlashAttention-4 (`pip install 'ocrq[fa4]'`) on an
    # SM80/SM90/SM100 GPU, else SDPA; "fa4" fails to load where it cannot run; "sdpa" is
    # PyTorch's SDPA (cuDNN on Hopper), one call per run of equal-sized images.
    vision_attention: VisionAttention = "auto"
    # The vision tower's linear layers: "auto" (the model's dtype, as Tencent runs them) or
    # "fp8" (e4m3, per-row and per-channel scales; ocrq/models/hunyuan/vision_fp8.py), which
    # fails to load where it cannot run. Not recommended: on an H200 slower (an A4 page's tower
    # 39.7 against 36.9 ms) and 6x the error of two bf16 kernels (bench/results/vision_fp8/).
    vision_gemm_dtype: VisionGemmDtype = "auto"
    # The running loop's packed text prefill, its causal attention: "auto" is FlashAttention-4
    # where the vision tower could use it (the same install and GPUs), else torch's flash
    # varlen kernel; "fa4" fails to load where it cannot run; "sdpa" is torch's kernel.
    prefill_attention: VisionAttention = "auto"
    # The running loop's KV pool: "auto" (the model's dtype) or "fp8" (e4m3, no scale: half the
    # bytes a decode step reads and twice the rows a pool holds; ocrq/models/hunyuan/kv_cache.py).
    kv_cache_dtype: KvCacheDtype = "auto"
    # With an fp8 pool: the decode kernel multiplies in e4m3 (queries and probabilities rounded
    # to it too) instead of widening every key and value to fp16; two more roundings for a
    # kernel nearer its bandwidth floor (ocrq/models/hunyuan/attention.py, fp8_products). Not
    # recommended: no faster on an H100 or an H200, at 23x the error (bench/results/kv_attention).
    kv_fp8_products: bool = False
    # The running loop's decode steps over buckets of at most this many slots (0: none, at most
    # 16) by the fused few-row step: five Triton kernels a layer, each weight streamed once,
    # instead of ~12 kernels and cuBLAS GEMMs (ocrq/models/hunyuan/fused_step.py). With Triton
    # attention only, and not with OCRQ_KV_FP8_PRODUCTS (the start-up log says when it is left
    # off; ocrq/models/hunyuan/step_choice.py). Off: alone it is 1.26x faster than today's step
    # at 1 row but no faster at 8 rows (H100), and in the loop on an H100, 8 slots (the smallest
    # bucket, the interactive lane's), its steps took 3.4 ms against 1.4 ms: the interactive
    # lane and bulk both slower (bench/results/fused_step/README.md, cause not yet found).
    loop_fused_step_rows: int = Field(default=0, ge=0, le=16)
    # The running loop's smallest decode bucket: 1, 2, 4 or 8 slots
    # (ocrq/models/hunyuan/loop_types.py). A step runs over the smallest bucket holding every
    # live row (the interactive lane's extra steps: every live interactive row), so at 8 a step
    # over one row still reads 8 rows' state; today's step took 1.21 ms at 1 row against 1.50
    # at 8 on an H100 (bench/results/fused_step/fused_step_h100_v3.md). Below 8: one CUDA graph
    # more per bucket, captured at warm-up. 8 until a loop run on a GPU shows them paying.
    loop_min_bucket: int = Field(default=8, ge=1, le=8)
    # How HunyuanOCR's prefetch threads make a row's inputs: "tensor" (ocrq's torch ops, equal
    # output, GIL released) or "processor" (transformers' processor, for comparison).
    preprocess: PreprocessMode = "tensor"

    # The running loop's prefill (OCRQ_SCHEDULER=continuous).
    # When the running loop prefills ("alternate": one big pass once a quarter of the slots are
    # free; "chunked": a chunk of OCRQ_PREFILL_CHUNK_TOKENS every OCRQ_PREFILL_GAP_STEPS decode
    # steps), and how many padded prompt tokens an "alternate" pass holds (their activations are
    # reserved in the memory budget).
    prefill_schedule: PrefillSchedule = "chunked"
    prefill_tokens: int = Field(default=16384, ge=256, le=1_048_576)
    # "chunked": decode steps between prefill passes unless a pass is full or nothing decodes.
    prefill_gap_steps: int = Field(default=4, ge=1, le=1024)
    # Prefill passes with their rows packed end to end, no padding: a pass then costs the tokens
    # it holds (ocrq/models/hunyuan/packed.py). On by default: on an H200 the service's mix made
    # 1.23x the images/s of padded passes, the GPU busy 99% instead of 82%
    # (bench/results/service_gpu/service_gpu_reading.md, run 14); false is the padded prefill.
    prefill_packed: bool = True
    # Prefill passes on a second CUDA stream of low priority while decode steps go on on the
    # running loop's own stream of high priority: a memory-bound step overlaps the
    # compute-bound pass, and an interactive row's steps no longer wait behind a whole pass
    # (a pass's rows join at the first step after it is done; ocrq/models/hunyuan/passes.py).
    # Off: on an H200 it cost bulk throughput (0.75x against 0.88x with an interactive stream;
    # bench/results/lanes/lanes_h200_prefill_stream.md); on an H100 it gave bulk 0.818x against
    # 0.78x, and with OCRQ_INTERACTIVE_PASS_STEPS the best pair measured there (one run each;
    # bench/results/lanes/README.md). The tokens are the same either way.
    prefill_stream: bool = False

    # The interactive lane's inner limits (ocrq/models/loop/lane_pass.py; docs/internals.md).
    # With OCRQ_PREFILL_STREAM: while a prefill pass runs on its side stream and an interactive
    # row of the reserve is live, the loop runs interactive-only steps (a few rows, bound by
    # reading the weights) in the pass's shadow (bound by compute) instead of full steps, which
    # wait for the pass to land as they do without the stream; each pass still gets one full
    # step beside it. So an interactive row decodes while bulk passes run, using the bandwidth
    # they leave over. On an H100 (one run): interactive p95 2.80x its latency alone at bulk
    # 0.817x, against 2.98-3.70x at 0.78x with the defaults (bench/results/lanes/README.md).
    # Off until an H200 run settles it.
    interactive_pass_steps: bool = False
    # While an interactive row waits or decodes: bulk prompt tokens per prefill pass (the pass's
    # first bulk row always goes), so no pass between its decode steps is long. 4,096: ~3 A4
    # pages, a quarter of OCRQ_PREFILL_CHUNK_TOKENS, whose passes of A4 pages took ~55 ms on the
    # H200 beside decode steps of a few ms. 0: no lane budget.
    interactive_prefill_tokens: int = Field(default=4096, ge=0, le=1_048_576)
    # While an interactive row waits or decodes: decode steps between passes that admit bulk
    # rows, full or not (interactive rows go in the next pass regardless). 4: as
    # OCRQ_PREFILL_GAP_STEPS; with the budget above, at most ~1,000 bulk prompt tokens a step
    # on average while the lane is busy (no cap outside it).
    interactive_prefill_gap_steps: int = Field(default=4, ge=1, le=1024)
    # While an interactive row waits or decodes: at most this many live bulk rows (0: no cap).
    # Off: a cap shortens every step an interactive row waits for, but takes bulk throughput
    # directly; set it when the loop's figures (ocrq_loop_lane_decode_seconds /
    # ocrq_loop_lane_steps against an idle loop's step time) say the step, not the prefill
    # passes, is what an interactive row waits for.
    interactive_bulk_rows: int = Field(default=0, ge=0, le=4096)

    @field_validator("loop_min_bucket")
    @classmethod
    def _a_bucket(cls, value: int) -> int:
        if value not in (1, 2, 4, 8):
            raise ValueError(f"OCRQ_LOOP_MIN_BUCKET must be 1, 2, 4 or 8 (a bucket), not {value}")
        return value


class LabSettings(HunyuanLabSettings):
    """Every lab lever: HunyuanOCR's (inherited) and the worker process's. `settings.lab`."""

    # Worker process.
    # The worker's GIL switch interval (sys.setswitchinterval), ms; None keeps Python's 5 ms.
    # A shorter one lets the thread that feeds the GPU take the GIL back sooner from the task
    # and preprocessing threads (bench/service_gpu.py compares).
    switch_interval_ms: float | None = Field(default=None, gt=0, le=100)
