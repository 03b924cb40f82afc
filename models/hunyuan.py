"""HunyuanOCR through transformers: load once, estimate without the GPU, generate in batches.

Design notes (the why):

* torch and transformers are an optional extra (`pip install 'ocrq[hunyuan]'`). This module
  imports them only inside functions, so importing it, building the engine and calling
  `estimate` or `cost_model` work on hosts without them.
* Weights are never downloaded during a job: `load` resolves the model to a directory (a local
  path, or the Hugging Face cache with local_files_only) and raises ModelNotFound with the
  command that fetches it when it is missing.
* One batch = one `generate` call over left-padded rows of mixed resolutions. Each row's output
  equals a batch-of-one run of the same image: left padding keeps every row's last prompt token
  at the end, and `_isolate_rows` stops transformers' multimodal RoPE from numbering images
  across the rows of a batch (it counts image 0, 1, 2... over the whole batch, while the model
  was trained, and a batch of one runs, with each sequence's image numbered 0).
* Each image is preprocessed on its own, so an image the processor rejects fails only its own
  item; the survivors still run as one batch.
* Attention is sdpa (or flash) and never eager: eager takes 13.1 GiB for one A4 page on the
  H200 where sdpa takes ~0.35 GiB.
* Decoding runs in models/hunyuan_decode.py by default (OCRQ_DECODE=fast): the model's own
  vision tower, a text prefill with fused norm/RoPE kernels, then a static KV cache and one CUDA
  graph per batch, 3.5 ms a step at batch 64 on an H200 where `generate()` takes 62-105 ms
  (bench/results/decode_speed_h200*.md), same greedy tokens, less peak memory.
  OCRQ_DECODE=generate keeps transformers' loop, and a generation config the fast loop cannot
  honour (a repetition penalty, say) falls back to it on its own.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.base import Engine, OcrResult, PreparedImage, UnsupportedTask
from models.costs import CostModel, GiB, ItemCost
from models.hunyuan_decode import (
    DecodeStats,
    HunyuanDecoder,
    attention_mode_from_env,
    batch_vision_attention,
    decode_mode_from_env,
    unsupported_reason,
)
from models.hunyuan_output import build_result
from models.hunyuan_tokens import (
    DEFAULT_GEOMETRY,
    MAX_PIXELS,
    ImageGeometry,
    item_cost,
    rough_prompt_tokens,
)
from ocrq.contract import TASK_PRESETS
from ocrq.settings import Settings

if TYPE_CHECKING:
    import torch
    from PIL import Image

log = logging.getLogger(__name__)

KiB = 1024

# Default memory model, measured on an H200 with the 1.0 shape in bf16 and sdpa
# (bench/results/hunyuan_engine_h200.md, transformers 5.17): 1.88 GiB of weights allocated and
# 2.52 GiB of device memory in use once loaded (CUDA context, allocator). The peak of a batch is
# reached in its prefill and is linear in the batch's prompt tokens: 159.9-160.1 KiB per prompt
# token (image tokens included; the vision tower's activations scale with them) for 1024² pages,
# 886x1699 receipts and A4 pages at batch 16 to 256 alike, up to 161.2 KiB at batch 1 (a
# per-call workspace; bench/results/hunyuan_engine_h200.json, decode_speed_h200.json): 162 KiB
# covers every one of them from above, by at most 1.3%.
# Decoding then holds the KV cache of prompt + new tokens: 96 KiB per token for this shape, plus
# one layer's prefill cache while it is copied (models/hunyuan_decode.py), hence x 25/24; that
# outgrows the prefill only for long generations (past ~640 new tokens on a 1024² page).
DEFAULT_WEIGHTS_BYTES = int(1.88 * GiB)
DEFAULT_FRAMEWORK_BYTES = int(0.64 * GiB)
DEFAULT_PER_TOKEN_BYTES = 162 * KiB
# The fused text prefill (models/hunyuan_decode.py) keeps fewer float32 intermediates: 137.8-137.9
# KiB per prompt token at batch 64 and 128 of every page size on the same H200.
DEFAULT_PER_TOKEN_BYTES_FUSED = 139 * KiB
DEFAULT_CACHE_TOKEN_BYTES = 96 * KiB * 25 / 24
DEFAULT_DECODE_FIXED_BYTES = 42 * 1024 * KiB

# Share of the device memory still free after loading that batches may use by default; the rest
# covers the allocator's fragmentation (reserved minus allocated) and cuBLAS/cuDNN workspaces.
DEFAULT_FREE_SHARE = 0.85

_PROMPT_CACHE_SIZE = 256
# Prefetch threads that may run the processor at once. Its Python holds the GIL, and the thread
# that feeds the GPU needs the GIL to launch each batch's thousands of kernels: 16 prefetch
# threads at once slowed a batch of 64 pages by 14-25% on the H200, 2 at once by nothing
# measurable, while 1 could not keep up (bench/results/prefill_profile_h200.md, "Prefetch
# beside a batch").
PREPROCESS_SLOTS = 2
# New tokens `probe` forces at most (see there): enough decode steps to reach the cache's
# growth, few enough that `ocrq tune` stays within seconds per probe.
PROBE_NEW_TOKENS = 64
_REFUSED_ATTENTION = {"eager"}


def default_cost_model(
    decode_path: str,
    cache_token_bytes: float = DEFAULT_CACHE_TOKEN_BYTES,
    decode_fixed_bytes: float = DEFAULT_DECODE_FIXED_BYTES,
) -> CostModel:
    """The measured default memory model for a decode path (see the constants above)."""
    fused = decode_path == "fast-fused"
    return CostModel(
        fixed_bytes=DEFAULT_WEIGHTS_BYTES + DEFAULT_FRAMEWORK_BYTES,
        per_token_bytes=float(DEFAULT_PER_TOKEN_BYTES_FUSED if fused else DEFAULT_PER_TOKEN_BYTES),
        per_cache_token_bytes=float(cache_token_bytes),
        decode_fixed_bytes=float(decode_fixed_bytes),
        source="default",
    )


class ModelNotFound(RuntimeError):
    """The configured model is not on this host; workers never download during a job."""


def resolve_model_dir(
    model: str, revision: str | None = None, subfolder: str | None = None
) -> Path:
    """The local directory holding config.json for `model`, or ModelNotFound saying how to get it.

    `model` is a local directory (with `subfolder` inside it, or the model itself) or a Hugging
    Face id looked up in the local cache only (HF_HOME / HF_HUB_CACHE are honoured, and so is
    HF_HUB_OFFLINE, since nothing here goes to the network).
    """
    local = Path(model).expanduser()
    if local.is_dir():
        candidates = [local / subfolder, local] if subfolder else [local]
        for candidate in candidates:
            if (candidate / "config.json").is_file():
                return candidate
        looked = " or ".join(str(c) for c in candidates)
        raise ModelNotFound(f"no HunyuanOCR checkpoint (config.json) in {looked}")
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise ModelNotFound(
            f"model directory {local} does not exist; set OCRQ_MODEL to a checkpoint directory "
            "or to a Hugging Face id such as tencent/HunyuanOCR"
        )

    from huggingface_hub import constants, snapshot_download

    fetch = f"hf download {model}"
    if revision:
        fetch += f" --revision {revision}"
    if subfolder:
        fetch += f" --include '{subfolder}/*'"
    missing = ModelNotFound(
        f"HunyuanOCR weights {model!r} (revision {revision or 'main'}, subfolder "
        f"{subfolder or '(root)'}) are not in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); workers never download during a job. Fetch them once "
        f"before starting the worker: `{fetch}`, or set OCRQ_MODEL to a local directory."
    )
    try:
        root = Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, or an offline/HTTP error in disguise
        raise missing from exc
    path = root / subfolder if subfolder else root
    if not (path / "config.json").is_file():
        raise missing
    return path


def snapshot_commit(path: Path | None) -> str | None:
    """The commit of the Hugging Face cache snapshot `path` lies in (…/snapshots/<commit>/…),
    else None (a plain local directory, or nothing loaded)."""
    if path is None:
        return None
    parts = Path(path).parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i + 1]
    return None


@dataclass
class EncodedImage:
    """One image after the processor: its prompt row and its vision inputs (CPU tensors)."""

    input_ids: torch.Tensor  # (seq,), image placeholder expanded to N tokens
    mm_token_type_ids: torch.Tensor  # (seq,), 1 on image tokens
    pixel_values: torch.Tensor  # (P, 3 * 16 * 16), already in the model's dtype
    image_grid_thw: torch.Tensor  # (1, 3)
    # (axes, seq) multimodal RoPE positions of this row alone; None when not computed
    positions: torch.Tensor | None = None


@dataclass
class Generated:
    """One row of a batched generation."""

    text: str
    token_ids: list[int]  # generated tokens, eos and padding removed
    capped: bool  # stopped at max_new_tokens instead of an eos
    prompt_tokens: int  # row length before padding, image tokens included
    logits: torch.Tensor | None = None  # (steps, vocab) float32, only when asked for


@dataclass
class BatchOutput:
    """Per-item results in input order (an Exception for an item that failed alone)."""

    items: list[Generated | Exception]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    padded_length: int = 0  # prompt length every row was padded to


def _isolate_rows(model: Any) -> None:
    """Compute multimodal RoPE positions row by row, so no row sees another row's images.

    transformers' `get_rope_index` gives every image an index on the last RoPE axis counted over
    the whole batch; a batch-of-one run (and training) numbers each sequence's images from 0.
    Wrapping the bound method on this instance keeps the library's own position logic, applied
    to one row at a time.
    """
    import torch

    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.shape[0] == 1 or image_grid_thw is None:
            return original(
                input_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=image_grid_thw,
                attention_mask=attention_mask,
                **kwargs,
            )
        positions, deltas = [], []
        next_grid = 0
        for row in range(input_ids.shape[0]):
            types = mm_token_type_ids[row]
            mask = attention_mask[row : row + 1] if attention_mask is not None else None
            if mask is not None:
                types = types[mask[0].bool()]
            is_image = types == 1
            n_images = int(is_image[0]) + int((is_image[1:] & ~is_image[:-1]).sum())
            grids = image_grid_thw[next_grid : next_grid + n_images]
            next_grid += n_images
            pos, delta = original(
                input_ids[row : row + 1],
                mm_token_type_ids=mm_token_type_ids[row : row + 1],
                image_grid_thw=grids,
                attention_mask=mask,
                **kwargs,
            )
            positions.append(pos)
            deltas.append(delta)
        return torch.cat(positions, dim=1), torch.cat(deltas, dim=0)

    inner.get_rope_index = get_rope_index


class HunyuanEngine(Engine):
    """Tencent HunyuanOCR (HunYuanVLForConditionalGeneration) on one device."""

    name = "hunyuan"
    # The processor never shows the model more than 2048² pixels, so prefetch may downscale
    # larger images to that before they wait in memory (updated from the loaded processor).
    max_pixels: int | None = MAX_PIXELS

    def __init__(self, settings: Settings, *, decode: str | None = None) -> None:
        """`decode`: "fast" (models/hunyuan_decode.py) or "generate" (transformers' loop); by
        default OCRQ_DECODE, else "fast". Kept off Settings while both paths are compared."""
        if settings.attention in _REFUSED_ATTENTION:
            raise ValueError(
                "OCRQ_ATTENTION=eager is refused: it needs ~13 GiB for one A4 page; "
                "use sdpa (default) or flash_attention_2"
            )
        if settings.max_new_tokens < 1:
            raise ValueError("OCRQ_MAX_NEW_TOKENS must be at least 1")
        self.settings = settings
        self.geometry: ImageGeometry = DEFAULT_GEOMETRY
        self.model: Any = None
        self.processor: Any = None
        self.model_dir: Path | None = None
        self.device: str | None = None
        self._generation_config: Any = None
        self._eos_ids: set[int] = set()
        self._pad_id: int = 0
        self._templates: OrderedDict[str, tuple[str, int]] = OrderedDict()
        # estimate() runs in the Celery task threads, run() in the batcher thread.
        self._templates_lock = threading.Lock()
        self._preprocess_slots = threading.BoundedSemaphore(PREPROCESS_SLOTS)
        self.decode = decode or decode_mode_from_env()
        if self.decode not in ("fast", "generate"):
            raise ValueError(f"decode must be 'fast' or 'generate', not {self.decode!r}")
        self._decoder: HunyuanDecoder | None = None
        self.last_decode: DecodeStats | None = None  # stats of the last fast batch (bench, logs)
        self._position_offset = 0  # tests only: a wrong decode RoPE offset must be caught

    @classmethod
    def from_settings(cls, settings: Settings) -> HunyuanEngine:
        return cls(settings)

    # -- loading -----------------------------------------------------------------------------

    def load(self) -> None:
        try:
            import torch
            from transformers import AutoProcessor, HunYuanVLForConditionalGeneration
        except ImportError as exc:
            raise ImportError(
                "the hunyuan engine needs torch, torchvision and transformers>=5.13: "
                "pip install 'ocrq[hunyuan]'"
            ) from exc

        # Expandable segments let the caching allocator grow blocks in place instead of
        # stranding reserved-but-unusable memory between batches of different shapes. Read at
        # the first CUDA allocation, so it must be set before any.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        started = time.perf_counter()
        s = self.settings
        path = resolve_model_dir(s.model, s.model_revision, s.model_subfolder)
        device = self._pick_device(torch)
        dtype = self._pick_dtype(torch, device)
        if device.startswith("cuda"):
            # The CPU work here is preprocessing, done by many prefetch threads at once (one per
            # task thread); torch's intra-op pool in each call would put threads x cores workers
            # on the cores and slow the thread that feeds the GPU. One intra-op thread each:
            # the prefetch threads are the parallelism. With 16 prefetch threads beside a batch
            # of 64 pages, that batch took 6-7% longer at 16 intra-op threads than at 1
            # (bench/results/prefill_profile_h200_threads.md).
            torch.set_num_threads(1)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        processor.tokenizer.padding_side = "left"
        model = HunYuanVLForConditionalGeneration.from_pretrained(
            path,
            local_files_only=True,
            dtype=dtype,
            attn_implementation=s.attention,
        )
        model.to(device).eval()  # no device_map: that would require accelerate
        _isolate_rows(model)
        batch_vision_attention(model)

        gen = copy.deepcopy(model.generation_config)
        gen.do_sample = False
        gen.num_beams = 1
        gen.temperature = gen.top_p = gen.top_k = None
        pad = processor.tokenizer.pad_token_id
        gen.pad_token_id = pad if pad is not None else gen.pad_token_id
        eos = gen.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if not eos_ids:
            eos_ids = {processor.tokenizer.eos_token_id}
        gen.eos_token_id = sorted(eos_ids)

        image_processor = processor.image_processor
        size = image_processor.size
        self.geometry = ImageGeometry(
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            extra_tokens=2 if getattr(processor, "cat_extra_token", True) else 0,
        )
        self.model, self.processor, self.model_dir, self.device = model, processor, path, device
        self._generation_config = gen
        self._eos_ids = eos_ids
        self._pad_id = int(gen.pad_token_id)
        self._decoder = None
        why_not = unsupported_reason(gen)
        if why_not:
            log.warning("fast decode cannot honour %s in the generation config; using generate()",
                        why_not)
        else:
            self._decoder = HunyuanDecoder(
                model, eos_ids=eos_ids, pad_id=self._pad_id, attention=attention_mode_from_env()
            )
        self.max_pixels = self.geometry.max_pixels
        with self._templates_lock:
            self._templates.clear()
        log.info(
            "hunyuan engine loaded %s on %s (%s, %s attention) in %.1f s",
            path, device, dtype, s.attention, time.perf_counter() - started,
        )

    def _pick_device(self, torch: Any) -> str:
        wanted = self.settings.device
        if wanted == "auto":
            return "cuda:0" if torch.cuda.is_available() else "cpu"
        if wanted.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"OCRQ_DEVICE={wanted} but torch sees no CUDA device")
        return wanted

    def _pick_dtype(self, torch: Any, device: str) -> Any:
        name = self.settings.dtype
        if name == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"OCRQ_DTYPE={name!r} is no torch dtype (bfloat16, float16, float32)")
        return dtype

    def default_budget_bytes(self) -> int:
        """On a GPU, a share of the memory left free after loading; elsewhere the base default."""
        if self.device is None or not self.device.startswith("cuda"):
            return super().default_budget_bytes()
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(self.device))
        return int(free * DEFAULT_FREE_SHARE)

    def fragmentation_bytes(self) -> int | None:
        if self.device is None or not self.device.startswith("cuda"):
            return None
        import torch

        torch.cuda.empty_cache()
        dev = torch.device(self.device)
        return int(torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))

    # -- memory measurement (`ocrq tune`): the device's own counters on a GPU --------------------

    def _cuda(self) -> bool:
        return self.device is not None and self.device.startswith("cuda")

    def release_memory(self) -> None:
        """After an OOM: drop the failed batch's garbage and return cached blocks to the device."""
        gc.collect()
        if self._cuda():
            import torch

            torch.cuda.empty_cache()

    def reset_peak_memory(self) -> None:
        if not self._cuda():
            return super().reset_peak_memory()
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int:
        """Peak bytes allocated by tensors on the device (weights included): what the cost
        model predicts. The allocator reserves a few percent more; budgets leave room for it."""
        if not self._cuda():
            return super().peak_memory_bytes()
        import torch

        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_capacity_bytes(self) -> int:
        if not self._cuda():
            return super().memory_capacity_bytes()
        import torch

        return int(torch.cuda.mem_get_info(torch.device(self.device))[1])

    def probe(self, batch: Sequence[PreparedImage]) -> list[ItemCost]:
        """Generate exactly min(max_new_tokens, PROBE_NEW_TOKENS) tokens per image.

        Forcing the length measures the worst case (a real model may stop early). The cap keeps
        a probe within seconds: the peak comes from the prefill, which is what the fit measures;
        the longer generation's KV cache is the cost model's decode part, computed from the
        model's shape (`cache_token_bytes`).
        """
        n = min(self.settings.max_new_tokens, PROBE_NEW_TOKENS)
        self.generate(batch, max_new_tokens=n, min_new_tokens=n)
        unused = self.settings.max_new_tokens - n
        return [
            replace(c, tokens=c.tokens - unused, new_tokens=n) for c in map(self.estimate, batch)
        ]

    def close(self) -> None:
        self.model = self.processor = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    def describe(self) -> dict[str, str]:
        s = self.settings
        facts = {
            "engine": self.name,
            "model": s.model,
            # The snapshot actually loaded, when it is one: a profile measured on an older
            # snapshot of the same branch is not this model's.
            "revision": snapshot_commit(self.model_dir) or s.model_revision or "main",
            "subfolder": s.model_subfolder or "",
            "dtype": s.dtype,
            "attention": s.attention,
            "device": self.device or s.device,
            "max_new_tokens": str(s.max_new_tokens),
            "decode": self.decode_path(),
        }
        try:
            import torch
            import transformers

            facts["torch"] = torch.__version__
            facts["transformers"] = transformers.__version__
            if self.device and self.device.startswith("cuda"):
                facts["gpu"] = torch.cuda.get_device_name(torch.device(self.device))
        except ImportError:
            pass
        return facts

    # -- planning ----------------------------------------------------------------------------

    @staticmethod
    def prompt_of(item: PreparedImage) -> str:
        """The instruction the model sees: the item's final prompt, else its task's preset."""
        if item.prompt:
            return item.prompt
        if item.task in TASK_PRESETS:
            return TASK_PRESETS[item.task]
        raise UnsupportedTask(f"task {item.task!r} is no preset and the item carries no prompt")

    def _template(self, prompt: str) -> tuple[str, int]:
        """(templated text, its token count without the image placeholder), cached per prompt."""
        with self._templates_lock:
            hit = self._templates.get(prompt)
            if hit is not None:
                self._templates.move_to_end(prompt)
                return hit
        messages = [
            {"role": "system", "content": ""},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
        ]
        text = self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        entry = (text, len(ids) - 1)  # the single image placeholder becomes N image tokens
        with self._templates_lock:
            self._templates[prompt] = entry
            if len(self._templates) > _PROMPT_CACHE_SIZE:
                self._templates.popitem(last=False)
        return entry

    def estimate(self, item: PreparedImage) -> ItemCost:
        """Tokens, patches and pixels of `item`, by arithmetic (raises ImageShapeError for an
        image the processor would refuse)."""
        prompt = self.prompt_of(item)
        if self.processor is not None:
            prompt_tokens = self._template(prompt)[1]
        else:
            prompt_tokens = rough_prompt_tokens(prompt)
        width, height = item.size
        return item_cost(
            width,
            height,
            prompt_tokens=prompt_tokens,
            max_new_tokens=self.settings.max_new_tokens,
            geometry=self.geometry,
        )

    def decode_path(self) -> str:
        """"fast-fused" (fused prefill and step kernels), "fast" (the lean loop on torch
        attention) or "generate": each holds different activations, so each has its own memory
        profile. Before loading, the configured mode."""
        if self.model is None:
            return self.decode
        if self.decode != "fast" or self._decoder is None:
            return "generate"
        return "fast-fused" if self._decoder.fused else "fast"

    def cost_model(self) -> CostModel:
        return default_cost_model(
            self.decode_path(), self.cache_token_bytes(), self.decode_fixed_bytes()
        )

    def decode_fixed_bytes(self) -> float:
        """The graphed decode phase's per-batch constant on a GPU, measured at batch 1 where the
        cache term is the peak: a 0.166 GiB peak increment after a 0.142 GiB prefill, against
        0.126 GiB of cache (bench/results/decode_speed_h200.json); 0 on the CPU."""
        return float(DEFAULT_DECODE_FIXED_BYTES) if self._cuda() else 0.0

    def cache_token_bytes(self) -> float:
        """K and V of every layer for one token, in the model's dtype, plus one layer's share
        (the prefill cache of the layer being copied into the static cache coexists with it)."""
        if self.model is None:
            return float(DEFAULT_CACHE_TOKEN_BYTES)
        cfg = self.model.config.text_config
        layers = int(cfg.num_hidden_layers)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        per_layer = 2 * int(cfg.num_key_value_heads) * head_dim * self.model.dtype.itemsize
        return float(per_layer * (layers + 1))

    # -- running -----------------------------------------------------------------------------

    def preprocess(self, item: PreparedImage) -> EncodedImage:
        """Run the processor on one image (CPU only; safe to call from a prefetch thread once
        the engine is loaded)."""
        if self.processor is None:
            raise RuntimeError("HunyuanEngine.load() must run before preprocess()")
        image = item.image if item.image.mode == "RGB" else item.image.convert("RGB")
        self.geometry.resized(*image.size)  # a clear ImageShapeError before the processor's own
        text, _ = self._template(self.prompt_of(item))
        with self._preprocess_slots:
            return self._encode(text, image)

    def _encode(self, text: str, image: Image.Image) -> EncodedImage:
        enc = self.processor(text=[text], images=[image], return_tensors="pt")
        return EncodedImage(
            input_ids=enc["input_ids"][0],
            mm_token_type_ids=enc["mm_token_type_ids"][0],
            pixel_values=self._staged_pixels(enc["pixel_values"]),
            image_grid_thw=enc["image_grid_thw"],
            positions=self._row_positions(enc),
        )

    def _staged_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """The row's pixels in the model's dtype and, on a GPU, in pinned host memory.

        Why in the prefetch thread: the batcher thread then neither casts nor concatenates a
        batch on the CPU while the GPU waits, and copies each row to the device asynchronously
        (pinned memory). Collated the plain way (float32 cast, one CPU `cat`, one pageable copy)
        with prefetch running beside it, a batch of 128 pages spent 0.75 s (1024²) to 1.4 s (A4)
        outside its prefill and decode (bench/results/decode_speed_h200_step1.json).
        """
        pixels = pixels.to(self.model.dtype)
        if self._cuda():
            pixels = pixels.pin_memory()  # torch's caching host allocator reuses these blocks
        return pixels

    def _row_positions(self, enc: Any) -> torch.Tensor:
        """This row's multimodal RoPE positions, by the library's own `get_rope_index` on the CPU.

        Why here: the positions depend on the row alone (`_isolate_rows`), and the library
        computes them with a Python loop over every prompt token with a device sync per row,
        0.28 s (1024² pages) to 0.45 s (A4) of an idle GPU per batch of 64 measured on an H200
        (bench/results/prefill_profile_h200_before.md). In the prefetch thread that cost overlaps
        the GPU's work on the batch before.
        """
        import torch

        with torch.no_grad():
            positions, _ = self.model.model.get_rope_index(
                enc["input_ids"],
                mm_token_type_ids=enc["mm_token_type_ids"],
                image_grid_thw=enc["image_grid_thw"],
            )
        return positions[:, 0]

    def prepare(self, item: PreparedImage) -> None:
        """Preprocess in the prefetch thread; `run` then skips the processor for this item."""
        item.encoded = self.preprocess(item)

    def _preprocess_or_error(self, item: PreparedImage) -> EncodedImage | Exception:
        if isinstance(item.encoded, EncodedImage):
            return item.encoded
        try:
            return self.preprocess(item)
        except Exception as exc:  # bad image or prompt: this item fails alone
            return exc

    def collate(
        self, rows: Sequence[EncodedImage], padding_side: str = "left", device: Any = None
    ) -> dict[str, Any]:
        """One batch of model inputs from encoded rows, padded to the longest row.

        Left padding is the only correct choice for generation (the next token is read at the
        last position of every row); `padding_side="right"` exists so tests can show that the
        equality checks catch broken padding. With `device`, every tensor is returned there and
        the pixels are copied row by row into one device tensor (asynchronously from pinned
        rows) instead of being concatenated on the CPU first.
        """
        import torch

        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        from torch.nn.utils.rnn import pad_sequence

        # One call per tensor kind, not a Python loop over rows: this runs in the thread that
        # feeds the GPU, while prefetch threads compete for the GIL.
        def padded(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
            return pad_sequence(
                tensors, batch_first=True, padding_value=value, padding_side=padding_side
            )

        input_ids = padded([r.input_ids for r in rows], self._pad_id)
        attention = padded([torch.ones_like(r.input_ids) for r in rows], 0)
        types = padded([r.mm_token_type_ids for r in rows], 0)
        positions = None
        if all(r.positions is not None for r in rows):
            # (axes, B, L); padding columns hold position 0 on every axis, as the library's do.
            positions = padded([r.positions.t() for r in rows], 0).permute(2, 0, 1)  # type: ignore[union-attr]
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "mm_token_type_ids": types,
            "image_grid_thw": torch.cat([r.image_grid_thw for r in rows], dim=0),
        }
        if positions is not None:
            inputs["position_ids"] = positions
        if device is None:
            inputs["pixel_values"] = torch.cat([r.pixel_values for r in rows], dim=0)
            return inputs
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        first = rows[0].pixel_values
        total = sum(r.pixel_values.shape[0] for r in rows)
        pixels = torch.empty((total, first.shape[1]), dtype=self.model.dtype, device=device)
        offset = 0
        for r in rows:
            n = r.pixel_values.shape[0]
            pixels[offset : offset + n].copy_(r.pixel_values, non_blocking=True)
            offset += n
        inputs["pixel_values"] = pixels
        return inputs

    def generate(
        self,
        batch: Sequence[PreparedImage],
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        output_logits: bool = False,
        padding_side: str = "left",
        encoded: Sequence[EncodedImage | Exception] | None = None,
        decode: str | None = None,
    ) -> BatchOutput:
        """Greedy generation for a batch; the building block of `run`, the tests and the bench.

        `min_new_tokens` (the bench sets it equal to max_new_tokens) forces a fixed length;
        `output_logits` keeps every step's raw logits per row (tests only: they take
        steps x vocab x 4 bytes per row). `encoded` hands in rows already preprocessed (by
        `preprocess`, in another thread say), one per item of `batch`. `decode` overrides the
        engine's decode mode for this call ("fast" falls back to "generate" where the generation
        config needs it).
        """
        import torch

        if self.model is None:
            raise RuntimeError("HunyuanEngine.load() must run before generate()")
        timings: dict[str, float] = {}
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
        rows = [encoded[i] for i in good]
        inputs = self.collate(rows, padding_side, device=self.model.device)  # type: ignore[arg-type]
        padded = int(inputs["input_ids"].shape[1])
        t1 = time.perf_counter()
        timings["preprocess"] = t1 - t0

        n_new = max_new_tokens or self.settings.max_new_tokens
        logits: torch.Tensor | None = None
        if (decode or self.decode) == "fast" and self._decoder is not None:
            # The fast loop takes the rows' own positions (collate); generate() computes them.
            new, logits, self.last_decode = self._decoder.generate(
                inputs,
                max_new_tokens=n_new,
                min_new_tokens=min_new_tokens,
                output_logits=output_logits,
                position_offset=self._position_offset,
            )
        else:
            inputs.pop("position_ids", None)  # generate() derives them from the inputs itself
            gen = copy.copy(self._generation_config)
            gen.max_new_tokens = n_new
            gen.min_new_tokens = min_new_tokens
            gen.return_dict_in_generate = True
            gen.output_logits = output_logits
            with torch.inference_mode():
                out = self.model.generate(**inputs, generation_config=gen)
            new = out.sequences[:, padded:].cpu()
            if output_logits:
                logits = torch.stack(out.logits, dim=1).float().cpu()
            del out
        t2 = time.perf_counter()
        timings["generate"] = t2 - t1

        token_rows: list[list[int]] = []
        capped: list[bool] = []
        for row in new.tolist():
            end = next((k for k, t in enumerate(row) if t in self._eos_ids), None)
            token_rows.append(row if end is None else row[:end])
            capped.append(end is None)
        texts = self.processor.batch_decode(
            token_rows, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        for j, i in enumerate(good):
            steps = len(token_rows[j]) + (0 if capped[j] else 1)  # the eos step has logits too
            items[i] = Generated(
                text=texts[j],
                token_ids=token_rows[j],
                capped=capped[j],
                prompt_tokens=len(rows[j].input_ids),
                logits=logits[j, :steps] if logits is not None else None,
            )
        timings["decode"] = time.perf_counter() - t2
        return BatchOutput(items=items, timings=timings, padded_length=padded)

    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        """OCR a batch: one OcrResult, or that image's own exception, per input, in order.

        Errors that concern the whole batch (CUDA out of memory) propagate to the batcher.
        """
        output = self.generate(batch)
        results: list[OcrResult | Exception] = []
        for item, gen in zip(batch, output.items, strict=True):
            if isinstance(gen, Exception):
                results.append(gen)
                continue
            try:
                task = "spotting" if self.prompt_of(item) == TASK_PRESETS["spotting"] else item.task
                results.append(
                    build_result(
                        gen.text, task=task, original_size=item.original_size, capped=gen.capped
                    )
                )
            except Exception as exc:
                results.append(exc)
        return results
