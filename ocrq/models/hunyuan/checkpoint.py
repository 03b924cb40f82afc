"""Finding HunyuanOCR on this host and loading it, never downloading it.

Why never download: a worker that fetches 2 GB in the middle of a job stalls every job it holds
and may fetch another revision than the one tuned. `resolve_model_dir` looks in a local folder or
the Hugging Face cache only (local_files_only) and, when the model is missing, raises
ModelNotFound with the exact command that fetches it; the worker stops at start-up with it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq.core.process import STATE, apply_env_defaults
from ocrq.core.settings import HunyuanSettings, ModelSettings
from ocrq.core.startup import gc_paused, uncached_bytecode

log = logging.getLogger(__name__)

REFUSED_ATTENTION = {"eager"}  # 13.1 GiB for one A4 page on the H200, where sdpa takes ~0.35
DEFAULT_REPO = "tencent/HunyuanOCR"
ROOT_EXTRAS = ("v1.0", "dflash")  # folders beside the root's 1.5 in DEFAULT_REPO
# config.json key that only ocrq's random-weight builder (ocrq/testing/tiny_hunyuan.py) sets:
# such weights never end a row, so `ocrq tune` draws its lengths (ocrq/tuning/lengths.py) and a
# bench scripts them (ocrq/testing/scripted.py refuses any other checkpoint).
RANDOM_MARK = "ocrq_random_weights"


def is_random_checkpoint(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get(RANDOM_MARK))


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
    elif model == DEFAULT_REPO:
        # The root holds HunyuanOCR-1.5; the archived 1.0 and the speculative-decoding draft
        # model beside it are not needed (Tencent's own command excludes v1.0/ too).
        fetch += " " + " ".join(f"--exclude '{folder}/*'" for folder in ROOT_EXTRAS)
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


def check_settings(settings: ModelSettings) -> None:
    """Refuse, before anything loads, settings that cannot serve (the attention is ocrq's own
    engine's: vLLM picks its own)."""
    if isinstance(settings, HunyuanSettings) and settings.attention in REFUSED_ATTENTION:
        raise ValueError(
            "OCRQ_ATTENTION=eager is refused: it needs ~13 GiB for one A4 page; "
            "use sdpa (default) or flash_attention_2"
        )
    if settings.max_new_tokens < 1:
        raise ValueError("OCRQ_MAX_NEW_TOKENS must be at least 1")


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model and processor, and where they came from."""

    model: Any  # HunYuanVLForConditionalGeneration, eval mode, on `device`
    processor: Any  # HunYuanVLProcessor, left padding
    path: Path
    device: str
    dtype: Any  # torch.dtype


def load_checkpoint(settings: HunyuanSettings) -> Checkpoint:
    """Resolve, then load the processor and the model onto the configured device."""
    timeline = STATE.timeline  # each step below is a phase of a worker's start
    try:
        with timeline.phase("torch import"), gc_paused():
            import torch
            from transformers import AutoProcessor, HunYuanVLForConditionalGeneration
    except ImportError as exc:
        raise ImportError(
            "the hunyuan engine needs torch, torchvision and transformers>=5.13: "
            "pip install 'ocrq[hunyuan]'"
        ) from exc
    if note := uncached_bytecode(torch):  # transformers is a lazy module: torch tells for both
        log.warning("%s", note)

    # The entry points set the process's environment defaults first (ocrq/core/process.py);
    # again here for code that loads an engine without one (tests, benches, a library user):
    # they are read at the first CUDA allocation, which may be below.
    apply_env_defaults()
    s = settings
    path = resolve_model_dir(s.model, s.model_revision, s.model_subfolder)
    device = _pick_device(torch, s.device)
    dtype = _pick_dtype(torch, s.dtype, device)
    if device.startswith("cuda"):
        # The CPU work here is preprocessing, done by many prefetch threads at once (one per
        # task thread); torch's intra-op pool in each call would put threads x cores workers
        # on the cores and slow the thread that feeds the GPU. One intra-op thread each:
        # the prefetch threads are the parallelism. With 16 prefetch threads beside a batch
        # of 64 pages, that batch took 6-7% longer at 16 intra-op threads than at 1
        # (bench/results/prefill_profile/prefill_profile_h200_threads.md).
        torch.set_num_threads(1)
    with timeline.phase("processor"):
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        processor.tokenizer.padding_side = "left"
    with timeline.phase("checkpoint read"):
        model = HunYuanVLForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=s.attention
        )
    with timeline.phase("model to device"):  # CUDA's own start-up too, on a GPU
        model.to(device).eval()  # no device_map: that would require accelerate
    return Checkpoint(model, processor, path, device, dtype)


def library_facts(cuda_device: str | None) -> dict[str, str]:
    """torch's and transformers' versions and, on a GPU, its name (what a profile is measured
    on); nothing where they are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    facts = {"torch": torch.__version__, "transformers": transformers.__version__}
    if cuda_device is not None:
        facts["gpu"] = torch.cuda.get_device_name(torch.device(cuda_device))
    return facts


def _pick_device(torch: Any, wanted: str) -> str:
    if wanted == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"OCRQ_DEVICE={wanted} but torch sees no CUDA device")
    return wanted


def _pick_dtype(torch: Any, name: str, device: str) -> Any:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"OCRQ_DTYPE={name!r} is no torch dtype (bfloat16, float16, float32)")
    return dtype
