"""HunyuanOCR through transformers: load once, estimate without the GPU, generate in batches.

Design notes (the why):

* torch and transformers are an optional extra (`pip install 'ocrq[hunyuan]'`). The package
  imports them only inside functions, so importing it, building the engine and calling
  `estimate` or `cost_model` work on hosts without them.
* Weights are never downloaded during a job (ocrq/models/hunyuan/checkpoint.py).
* One batch = one generation over left-padded rows of mixed resolutions. Each row's output
  equals a batch-of-one run of the same image: left padding keeps every row's last prompt token
  at the end, and ocrq/models/hunyuan/patches.py keeps transformers from numbering images across
  the rows of a batch.
* Each image is preprocessed on its own (ocrq/models/hunyuan/inputs.py, in the prefetch threads), so
  an image the processor rejects fails only its own item; the survivors still run as one batch.
* Decoding runs in ocrq/models/hunyuan/decode.py by default (`Settings.decode`, OCRQ_DECODE=fast):
  the model's own vision tower, a text prefill with fused norm/RoPE kernels, then a static KV
  cache and one CUDA graph per batch, 3.5 ms a step at batch 64 on an H200 where `generate()`
  takes 62-105 ms (bench/results/decode_speed/decode_speed_h200*.md), same greedy tokens, less peak
  memory. OCRQ_DECODE=generate keeps transformers' loop, and a generation config the fast loop
  cannot honour (an n-gram ban, say) falls back to it on its own
  (ocrq/models/hunyuan/generation.py).
* HunyuanOCR 1.0 and 1.5 load through this same code; the checkpoint's config says which it is
  (ocrq/models/hunyuan/versions.py), and the version brings its prompts, its repetition penalty and
  its image limit. Both loops apply the penalty and stop rows whose tail loops
  (ocrq/models/hunyuan/repetition.py); such a row's result says `truncated="repetition"`.
* Each task shows the model a preset number of pixels (ocrq/models/hunyuan/resolution.py), which the
  estimate counts, so a batch is planned for the image the model will really see.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ocrq.core.process import STATE
from ocrq.core.settings import HunyuanSettings
from ocrq.models.base import Engine, OcrResult, PreparedImage
from ocrq.models.costs import CostModel, ItemCost
from ocrq.models.hunyuan.checkpoint import (
    check_settings,
    library_facts,
    load_checkpoint,
    snapshot_commit,
)
from ocrq.models.hunyuan.decode import DecodeStats, HunyuanDecoder, fast_decoder
from ocrq.models.hunyuan.fidelity import follow_training
from ocrq.models.hunyuan.generation import (
    DECODE_MODES,
    BatchOutput,
    generate_plain,
    generated_rows,
    greedy_config,
)
from ocrq.models.hunyuan.geometry import DEFAULT_GEOMETRY, ImageGeometry, geometry_of, item_cost
from ocrq.models.hunyuan.hooks import DecodeHooks, installed
from ocrq.models.hunyuan.inputs import EncodedImage, Preprocessor, collate, fit_to_cap
from ocrq.models.hunyuan.memory import (
    DEFAULT_DECODE_FIXED_BYTES,
    HunyuanMemory,
    cache_token_bytes,
    default_cost_model,
)
from ocrq.models.hunyuan.output import result_of
from ocrq.models.hunyuan.patches import batch_vision_attention, isolate_rows
from ocrq.models.hunyuan.prompts import PromptTemplates, prompt_of, rough_prompt_tokens
from ocrq.models.hunyuan.resolution import ModelPixels
from ocrq.models.hunyuan.tokens import SpecialTokens
from ocrq.models.hunyuan.versions import (
    LATEST,
    ModelVersion,
    RepetitionGuard,
    version_of_checkpoint,
)
from ocrq.models.hunyuan.vision_attention import choose, fa4_kernel

log = logging.getLogger(__name__)

class HunyuanEngine(ModelPixels, HunyuanMemory, Engine):
    """Tencent HunyuanOCR (HunYuanVLForConditionalGeneration) on one device, in static batches
    (its running loop: `HunyuanLoopEngine`, ocrq/models/hunyuan/loop_engine.py)."""

    name = "hunyuan"
    # The processor never shows the model more than its limit (2048² pixels for 1.0, ~4096² for
    # 1.5), so prefetch may downscale larger images to that before they wait in memory (set
    # from the loaded processor): every pixel budget's `model_limit`.
    model_limit: int | None = LATEST.max_pixels

    def __init__(
        self,
        settings: HunyuanSettings,
        *,
        decode: str | None = None,
        hooks: DecodeHooks | None = None,
    ) -> None:
        """`settings`: this engine's group (a whole Settings is narrowed to it here). `decode`:
        "fast" (ocrq/models/hunyuan/decode.py) or "generate" (transformers' loop); by default
        `settings.decode`. Tests and benches pass it to compare both on one setting.
        `hooks`: a bench's (ocrq/models/hunyuan/hooks.py), else the ones installed in this
        process; the service's engine has none, and its loops run the model's choice alone."""
        settings = HunyuanSettings.of(settings)
        check_settings(settings)
        self.settings = settings
        self.decode = decode or settings.decode
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, not {self.decode!r}")
        self.geometry: ImageGeometry = DEFAULT_GEOMETRY
        self.model: Any = None
        self.processor: Any = None
        self.model_dir: Path | None = None
        self.device: str | None = None
        self.hooks: DecodeHooks | None = hooks if hooks is not None else installed()
        self.tokens: SpecialTokens | None = None  # the one place eos and pad ids live
        self.templates: PromptTemplates | None = None
        self.preprocess_row: Preprocessor | None = None
        self._generation_config: Any = None
        self._decoder: HunyuanDecoder | None = None
        self.last_decode: DecodeStats | None = None  # stats of the last fast batch (bench, logs)
        # What the loaded checkpoint is (its config.json says); before loading, the latest,
        # whose image limit the geometry then takes.
        self.version: ModelVersion = LATEST
        self.geometry = replace(DEFAULT_GEOMETRY, max_pixels=LATEST.max_pixels)
        self.repetition_penalty: float = LATEST.repetition_penalty
        self.vision_attention: str = "sdpa"  # the kernel `load` chose for the vision tower
        self.prefill_attention: str = "sdpa"  # and for the packed text prefill's attention
        self.vision_gemm_dtype: str = ""  # the vision layers' linears once loaded ("fp8", ...)

    @classmethod
    def from_settings(cls, settings: HunyuanSettings) -> HunyuanEngine:
        return cls(settings)

    # -- loading -----------------------------------------------------------------------------

    def load(self) -> None:
        started = time.perf_counter()
        ckpt = load_checkpoint(self.settings)
        set_up = time.time()  # a phase of a worker's start (ocrq/core/startup.py)
        model, processor = ckpt.model, ckpt.processor
        isolate_rows(model)
        self.vision_attention = self._vision_kernel(model)
        batch_vision_attention(
            model, kernel=fa4_kernel() if self.vision_attention == "fa4" else None
        )
        s = self.settings
        follow_training(model, rope=s.hunyuan_rope, vit_positions=s.hunyuan_vit_positions)
        self.vision_gemm_dtype = self._vision_gemms(model)
        self.version = version_of_checkpoint(ckpt.path)
        gen = greedy_config(model.generation_config)
        # The checkpoint's own penalty where its generation config names one, else Tencent's
        # for this version (1.08 for 1.5); both loops apply it.
        own = getattr(gen, "repetition_penalty", None)
        self.repetition_penalty = (
            float(own) if own not in (None, 1.0) else self.version.repetition_penalty
        )
        gen.repetition_penalty = self.repetition_penalty
        self.tokens = SpecialTokens.read(gen, processor.tokenizer)
        self.geometry = geometry_of(processor)
        self.model_limit = self.geometry.max_pixels
        self.model, self.processor = model, processor
        self.model_dir, self.device = ckpt.path, ckpt.device
        self._generation_config = gen
        self.templates = PromptTemplates(processor)
        for prompt in self.version.prompts.values():  # a template error shows at start-up
            self.templates(prompt)
        self.preprocess_row = Preprocessor(
            model,
            processor,
            self.templates,
            self.geometry,
            pin=self._cuda(),
            prompt_for=self.prompt_for,
            cap_of=self.view_pixels,
            mode=self.settings.preprocess,
        )
        if self.preprocess_row.spans is not None:  # a tokenizer the tensor path cannot splice
            for prompt in self.version.prompts.values():  # shows at start-up, not per job
                self.preprocess_row.spans.pieces(self.templates(prompt)[0])
        self._decoder = fast_decoder(model, gen, attention=self.settings.decode_attention)
        self.prefill_attention = self._prefill_kernel(model)
        if self._decoder is not None and self.prefill_attention == "fa4":
            self._decoder.text.causal_kernel = fa4_kernel(causal=True)
        STATE.timeline.since("engine set-up", set_up)
        log.info(
            "hunyuan engine loaded HunyuanOCR-%s from %s on %s (%s, %s attention, %s vision "
            "attention, %s vision GEMMs, %s prefill attention, repetition penalty %s, "
            "max %d pixels, %s "
            "preprocessing, RoPE layout %s, "
            "ViT positions %s) in %.1f s",
            self.version.name,
            ckpt.path,
            ckpt.device,
            ckpt.dtype,
            self.settings.attention,
            self.vision_attention,
            self.vision_gemm_dtype,
            self.prefill_attention,
            self.repetition_penalty,
            self.geometry.max_pixels,
            self.settings.preprocess,
            self.settings.hunyuan_rope,
            self.settings.hunyuan_vit_positions,
            time.perf_counter() - started,
        )

    def _vision_kernel(self, model: Any) -> str:
        """`Settings.vision_attention` resolved for this model and device ("fa4" or "sdpa");
        "sdpa" also where the checkpoint loaded with another attention than SDPA, whose own
        path the patch leaves alone."""
        tower = model.model.vision_tower
        if getattr(tower.config, "_attn_implementation", "sdpa") != "sdpa":
            return "sdpa"
        attn = tower.layers[0].self_attn
        param = next(tower.parameters())
        return choose(self.settings.vision_attention, param.device, param.dtype, attn.head_dim)

    def _vision_gemms(self, model: Any) -> str:
        """`Settings.vision_gemm_dtype` applied: "fp8" swaps the vision layers' linears
        (ocrq/models/hunyuan/vision_fp8.py, imported only then: it needs torch at import) and
        fails to load, saying why, where fp8 cannot run; "auto" leaves the model's dtype."""
        if self.settings.vision_gemm_dtype != "fp8":
            return str(next(model.model.vision_tower.parameters()).dtype).removeprefix("torch.")
        from ocrq.models.hunyuan.vision_fp8 import fp8_unusable, fp8_vision_linears

        device = next(model.model.vision_tower.parameters()).device
        reason = fp8_unusable(device)
        if reason is not None:
            raise RuntimeError(f"vision_gemm_dtype=fp8, but fp8 GEMMs cannot run: {reason}")
        fp8_vision_linears(model)
        return "fp8"

    def _prefill_kernel(self, model: Any) -> str:
        """`Settings.prefill_attention` resolved for the text decoder ("fa4" or "sdpa")."""
        param = next(model.model.language_model.parameters())
        head_dim = int(model.model.language_model.layers[0].self_attn.head_dim)
        return choose(self.settings.prefill_attention, param.device, param.dtype, head_dim,
                      name="prefill_attention")

    def close(self) -> None:
        self.model = self.processor = self.preprocess_row = self._decoder = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    def preferred_max_batch(self) -> int:
        """256 rows on a GPU: the fast loop's images/s still rose from 128 to 256 rows on an
        H200 (A4 7.7 -> 8.2 pages/s, receipts 10.2 -> 11.7); the budget trims each batch below
        it. 512 with an fp8 KV pool. On a CPU a batch is as slow per row as one image: 8 keeps
        latency sane."""
        if not self._cuda():
            return 8
        # An fp8 pool holds twice the rows in the same bytes: slots for them.
        return 512 if self.settings.kv_cache_dtype == "fp8" else 256

    def describe(self) -> dict[str, str]:
        s = self.settings
        facts = {
            "engine": self.name,
            "model": s.model,
            # The snapshot actually loaded, when it is one: a profile measured on an older
            # snapshot of the same branch is not this model's.
            "revision": snapshot_commit(self.model_dir) or s.model_revision or "main",
            "subfolder": s.model_subfolder or "",
            # Known once loaded: 1.0 and 1.5 take different pixels, so profiles are apart.
            "version": self.version.name if self.model is not None else "",
            "dtype": s.dtype,
            "attention": s.attention,
            "device": self.device or s.device,
            "max_new_tokens": str(s.max_new_tokens),
            "decode": self.decode_path(),
            # Logs only, not a profile key: fp8 frees more weight bytes than its quantised
            # activations take, so a profile measured without it stays on the safe side.
            "vision_gemm_dtype": s.vision_gemm_dtype,
        }
        facts.update(library_facts(self.device if self._cuda() else None))
        return facts

    # -- planning ----------------------------------------------------------------------------

    def prompt_for(self, item: PreparedImage) -> str:
        """The instruction for `item` in the loaded version (UnsupportedTask for a task name
        this version does not offer)."""
        return prompt_of(item, self.version.prompts, self.version.name)

    def estimate(self, item: PreparedImage) -> ItemCost:
        """Tokens, patches and pixels of `item` as the model will see it (its resolution preset
        applied), by arithmetic; raises ImageShapeError for an image the processor would refuse
        and UnsupportedTask for a task the loaded version lacks."""
        prompt = self.prompt_for(item)
        if self.templates is not None:
            prompt_tokens = self.templates.prompt_tokens(prompt)
        else:
            prompt_tokens = rough_prompt_tokens(prompt)
        self.geometry.resized(*item.size)  # the processor's own refusals first
        size = self.geometry.shrink_to(*item.size, self.view_pixels(item))
        return item_cost(
            *size,
            prompt_tokens=prompt_tokens,
            max_new_tokens=self.row_cap(item),
            geometry=self.geometry,
        )

    def row_cap(self, item: PreparedImage) -> int:
        """New tokens `item` may make: its own cap within the engine's."""
        cap = self.settings.max_new_tokens
        return cap if item.max_new_tokens is None else max(1, min(item.max_new_tokens, cap))

    def decode_path(self) -> str:
        """ "fast-fused" (fused prefill and step kernels), "fast" (the lean loop on torch
        attention) or "generate": each holds different activations, so each has its own memory
        profile. Before loading, the configured mode."""
        if self.model is None:
            return self.decode
        if self.decode != "fast" or self._decoder is None:
            return "generate"
        return "fast-fused" if self._decoder.fused else "fast"

    def cost_model(self) -> CostModel:
        """The measured default for this version; its decode part from the loaded model's
        shape."""
        decode_fixed = float(DEFAULT_DECODE_FIXED_BYTES) if self._cuda() else 0.0
        return default_cost_model(
            self.decode_path(), cache_token_bytes(self.model), decode_fixed, self.version.name
        )

    def pass_tokens(self) -> int:
        """The padded prompt tokens of the largest prefill pass the running loop runs, which its
        budget reserves (and `ocrq tune` suggests to vLLM as its tokens per step): a chunk under
        the "chunked" schedule (a row over it is downscaled to fit by the planner),
        OCRQ_PREFILL_TOKENS under "alternate". Reserving the larger pass in chunked mode
        over-predicted the H200's peak by 12% (bench/results/service_gpu/service_gpu_reading.md)."""
        s = self.settings
        return s.prefill_chunk_tokens if s.prefill_schedule == "chunked" else s.prefill_tokens

    # -- running -----------------------------------------------------------------------------

    def preprocess(self, item: PreparedImage) -> EncodedImage:
        """Make one image's row (CPU only; safe to call from a prefetch thread once the engine
        is loaded): by ocrq's tensor ops or transformers' processor (OCRQ_PREPROCESS)."""
        if self.preprocess_row is None:
            raise RuntimeError("HunyuanEngine.load() must run before preprocess()")
        return self.preprocess_row(item)

    def prepare(self, item: PreparedImage) -> None:
        """Preprocess in the prefetch thread; `run` then skips preprocessing for this item.
        The image is first shrunk to its resolution preset, so a 300 dpi page waits in memory
        at the size the model will see."""
        item.image = fit_to_cap(item.image, self.geometry, self.view_pixels(item))
        item.encoded = self.preprocess(item)

    def _preprocess_or_error(self, item: PreparedImage) -> EncodedImage | Exception:
        if isinstance(item.encoded, EncodedImage):
            return item.encoded
        try:
            return self.preprocess(item)
        except Exception as exc:  # bad image or prompt: this item fails alone
            return exc

    def _collate(self, rows: Sequence[EncodedImage]) -> dict[str, Any]:
        """The batch's inputs on the model's device, left-padded."""
        assert self.tokens is not None
        return collate(rows, self.tokens.pad, device=self.model.device, dtype=self.model.dtype)

    def generate(
        self,
        batch: Sequence[PreparedImage],
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        output_logits: bool = False,
        encoded: Sequence[EncodedImage | Exception] | None = None,
        decode: str | None = None,
        guard: RepetitionGuard | bool | None = True,
    ) -> BatchOutput:
        """Greedy generation for a batch; the building block of `run`, the tests and the bench.

        `min_new_tokens` (the bench sets it equal to max_new_tokens) forces a fixed length (the
        repetition guard never stops a row before it); `output_logits` keeps every step's raw
        logits and the scores chosen from per row (tests only: they take steps x vocab x 8
        bytes per row). `encoded` hands in rows already preprocessed (by `preprocess`, in
        another thread say), one per item of `batch`. `decode` overrides the engine's decode
        mode for this call ("fast" falls back to "generate" where the generation config needs
        it). `guard`: True for the version's repetition guard, False or None for none (the
        bench measures what it saves), or another guard.
        """
        if self.model is None or self.tokens is None:
            raise RuntimeError("HunyuanEngine.load() must run before generate()")
        tokens = self.tokens
        t0 = time.perf_counter()
        if encoded is None:
            encoded = [self._preprocess_or_error(item) for item in batch]
        elif len(encoded) != len(batch):
            raise ValueError(f"{len(encoded)} encoded rows for a batch of {len(batch)}")
        good = [i for i, e in enumerate(encoded) if not isinstance(e, Exception)]
        # Filled in below for the rows that run; failed items keep their exception.
        items: list[Any] = [e if isinstance(e, Exception) else None for e in encoded]
        if not good:
            return BatchOutput(items=items, timings={"preprocess": time.perf_counter() - t0})
        rows: list[EncodedImage] = [encoded[i] for i in good]  # type: ignore[misc]
        inputs = self._collate(rows)
        padded = int(inputs["input_ids"].shape[1])
        t1 = time.perf_counter()

        # Each job's own cap (`row_cap`): the batch runs to the largest, and each row is cut at
        # its own below (the planner budgets each row's KV for its own cap, too).
        caps = None if max_new_tokens else [self.row_cap(batch[i]) for i in good]
        n_new = max_new_tokens or max(caps or [self.settings.max_new_tokens])
        loop_guard = self.version.guard if guard is True else (guard or None)
        if (decode or self.decode) == "fast" and self._decoder is not None:
            # The fast loop takes the rows' own positions (collate); generate() computes them.
            fast = self._decoder.generate(
                inputs,
                tokens,
                eos_at=(
                    None if self.hooks is None else [self.hooks.eos_at(batch[i].key) for i in good]
                ),
                max_new_tokens=n_new,
                min_new_tokens=min_new_tokens,
                output_logits=output_logits,
                repetition_penalty=self.repetition_penalty,
                guard=loop_guard,
            )
            new, logits, scores, stopped = fast.tokens, fast.logits, fast.scores, fast.stopped
            self.last_decode = fast.stats
        else:
            new, logits, scores, stopped = generate_plain(
                self.model,
                self._generation_config,
                tokens,
                inputs,
                max_new_tokens=n_new,
                min_new_tokens=min_new_tokens,
                output_logits=output_logits,
                guard=loop_guard,
            )
        t2 = time.perf_counter()

        lengths = [len(r.input_ids) for r in rows]
        done = generated_rows(
            new, logits, tokens, self.processor, lengths, scores=scores, stopped=stopped, caps=caps
        )
        for i, row in zip(good, done, strict=True):
            items[i] = row
        timings = {"preprocess": t1 - t0, "generate": t2 - t1, "decode": time.perf_counter() - t2}
        return BatchOutput(items=items, timings=timings, padded_length=padded)

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        """OCR a batch: one OcrResult, or that image's own exception, per input, in order.

        Errors that concern the whole batch (CUDA out of memory) propagate to the batcher.
        """
        output = self.generate(batch)
        results: list[OcrResult | Exception] = []
        prompts = self.version.prompts
        for item, gen in zip(batch, output.items, strict=True):
            results.append(gen if isinstance(gen, Exception) else result_of(item, gen, prompts))
        return results
