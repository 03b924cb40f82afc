"""What the HunyuanOCR tests share: the tiny checkpoints in a fake Hugging Face cache, images,
engines, and the test-only ways to break an engine on purpose.

The checkpoints themselves are built by ocrq/testing/tiny_hunyuan.py (benchmarks use it too): the
fake
cache holds tencent/HunyuanOCR as the real repository does since July 2026, a tiny 1.5 at its
root and a tiny 1.0 under v1.0/. The knobs that exist only to show a check can fail (right
padding, a shifted decode position, a dropped repetition penalty) live here, as subclasses, and
not in the production engine.

torch is imported inside functions so that collection works where it is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from ocrq.core.settings import Settings
from ocrq.models.base import PreparedImage
from ocrq.models.hunyuan import HunyuanEngine
from ocrq.models.hunyuan.decode import HunyuanDecoder
from ocrq.models.hunyuan.inputs import EncodedImage, collate

MODEL_ID = "tencent/HunyuanOCR"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hf_cache(root: Path, build: Any) -> Path:
    """A Hugging Face cache holding MODEL_ID at COMMIT: `build(folder, version)` writes 1.5 at
    the snapshot's root and 1.0 under v1.0/, the repository's layout."""
    repo = root / ("models--" + MODEL_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    build(snapshot, "1.5")
    build(snapshot / "v1.0", "1.0")
    return root


def tiny_hf_cache(root: Path) -> Path:
    """The tiny checkpoints as MODEL_ID in a fake cache at `root`, for a worker process (its
    env names the cache: `loop_worker_env`)."""
    from ocrq.testing.tiny_hunyuan import TINY_SHAPES, build_checkpoint

    return fake_hf_cache(root, lambda p, version: build_checkpoint(p, TINY_SHAPES[version]))


def loop_worker_env(
    service_env: dict[str, str],
    cache: Path,
    queue: str,
    *,
    max_new_tokens: int,
    max_batch: int,
    budget_gib: float,
    engine_process: str,
    profile_dir: Path,
    metrics_port: int,
) -> dict[str, str]:
    """An `ocrq worker` running the tiny 1.5 model in the running loop on the CPU, its engine in
    the worker (`engine_process="off"`) or in a process of its own ("on"). Small prefill passes
    (1,024 tokens) keep a CPU step short; `budget_gib` is planned with the GPU's default model
    (2.52 GiB fixed), so it sets the room for rows of `max_new_tokens`."""
    return {
        **service_env,
        "OCRQ_ENGINE": "hunyuan",
        "OCRQ_QUEUE": queue,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "OCRQ_DEVICE": "cpu",
        "OCRQ_DTYPE": "float32",
        "OCRQ_MAX_NEW_TOKENS": str(max_new_tokens),
        "OCRQ_SCHEDULER": "continuous",
        "OCRQ_MAX_BATCH": str(max_batch),
        "OCRQ_MEMORY_BUDGET_GIB": str(budget_gib),
        "OCRQ_PREFILL_TOKENS": "1024",
        "OCRQ_PREFILL_CHUNK_TOKENS": "1024",
        "OCRQ_PROFILE_DIR": str(profile_dir),
        "OCRQ_METRICS_PORT": str(metrics_port),
        "OCRQ_ENGINE_PROCESS": engine_process,
    }


@contextmanager
def offline_tiny_cache(root: Path) -> Iterator[Path]:
    """The tiny checkpoints as MODEL_ID in a fake cache at `root`, with huggingface_hub pointed
    at it and offline for the duration."""
    from ocrq.testing.tiny_hunyuan import TINY_SHAPES, build_checkpoint

    fake_hf_cache(root, lambda p, version: build_checkpoint(p, TINY_SHAPES[version]))
    with pytest.MonkeyPatch.context() as mp:
        import huggingface_hub.constants as hf_constants

        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(root))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        yield root


def tiny_checkpoint(folder: Path, version: str = "1.0") -> Path:
    """A tiny checkpoint of `version` as a plain local folder."""
    from ocrq.testing.tiny_hunyuan import TINY_SHAPES, build_checkpoint

    return build_checkpoint(folder / f"tiny-{version}", TINY_SHAPES[version])


def cpu_settings(
    model: str, max_new_tokens: int, subfolder: str | None = None, **extra: Any
) -> Settings:
    return Settings(
        model=model,
        model_subfolder=subfolder,
        model_revision=None,
        dtype="float32",
        device="cpu",
        max_new_tokens=max_new_tokens,
        **extra,
    )


def noise(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def item(
    w: int,
    h: int,
    seed: int,
    task: str = "text",
    prompt: str = "",
    scale: int = 1,
    job_cap: int | None = None,
) -> PreparedImage:
    """A noise image; `scale` makes its original size that many times larger (boxes then map
    back to pixels the model never saw)."""
    return PreparedImage(
        f"img{seed}",
        noise(w, h, seed),
        (w * scale, h * scale),
        task=task,
        prompt=prompt,
        job_cap=job_cap,
    )


def mixed(first_seed: int, scale: int = 1) -> list[PreparedImage]:
    """Mixed resolutions and prompts, so the rows have different lengths and get padded."""
    s = first_seed
    return [
        item(100, 150, s, scale=scale),
        item(160, 90, s + 1, task="spotting", scale=scale),
        item(64, 64, s + 2, scale=scale),
        item(300, 40, s + 3, task="custom", prompt="Read the line.", scale=scale),
    ]


def max_diff(a: Any, b: Any, steps: slice = slice(None)) -> float:
    """Largest difference of two rows' per-step logits over `steps` (the shorter's length)."""
    n = min(len(a.logits), len(b.logits))
    return float((a.logits[:n][steps] - b.logits[:n][steps]).abs().max())


class RightPadded(HunyuanEngine):
    """Pads on the wrong side: the padded rows' outputs must then differ (the checks can fail)."""

    def _collate(self, rows: Any) -> dict[str, Any]:
        assert self.tokens is not None
        return collate(
            rows,
            self.tokens.pad,
            device=self.model.device,
            dtype=self.model.dtype,
            padding_side="right",
        )


class ShiftedDecoder(HunyuanDecoder):
    """Starts every row's decode positions one too far (the prefill is untouched)."""

    def _prefill(self, *args: Any) -> Any:
        state, logits = super()._prefill(*args)
        state.pos += 1
        return state, logits


class UnpenalisedDecoder(HunyuanDecoder):
    """Drops the repetition penalty whatever the engine asks for."""

    def _prefill(self, inputs: Any, tokens: Any, n_new: int, penalty: float = 1.0) -> Any:
        return super()._prefill(inputs, tokens, n_new, 1.0)


def rows(engine: HunyuanEngine, items: list[PreparedImage]) -> list[EncodedImage]:
    return [engine.preprocess(it) for it in items]
