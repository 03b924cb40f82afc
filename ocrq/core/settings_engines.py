"""What an operator sets for the engine a worker runs: one group per engine (the CPU engine
rapid; HunyuanOCR in ocrq's own engine, in vLLM, or behind an OpenAI-compatible server), each
of ocrq/core/settings.py's `Settings`. An engine is built from its own group only
(ocrq/models/registry.py). HunyuanOCR's own engine also inherits its lab levers
(ocrq/core/settings_lab.py), which operators leave alone."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from ocrq.core.contract import MAX_NEW_TOKENS_LIMIT
from ocrq.core.settings_group import SettingsGroup
from ocrq.core.settings_lab import HunyuanLabSettings
from ocrq.core.settings_service import BudgetSettings

# How rows share the device: whole batches run to their longest row ("static"), or the running
# loop, where finished rows leave at once and waiting ones take their slots ("continuous",
# ocrq/models/hunyuan/running.py).
Scheduler = Literal["auto", "static", "continuous"]
# Engine rapid's model sets: the names of ocrq/models/rapid/models.py's MODEL_SETS (a test keeps
# the two lists equal; core may not import the engine).
RapidModels = Literal["v6-small", "v4"]



class RapidSettings(SettingsGroup):
    """OCRQ_ENGINE=rapid: the CPU engine (ocrq/models/rapid)."""

    # The CPU engine rapid (OCRQ_ENGINE=rapid; docs/engines.md).
    # Its model set: "v6-small" (PP-OCRv6 small, multilingual; better than v4 on receipts, words,
    # scenes and the 3-column page, at less CPU) or "v4" (PP-OCRv4 mobile, Chinese and English,
    # the default before). Empty means "v6-small". Both ship inside pinned wheels of the base
    # install; nothing is downloaded. Measured on the shared eval set in
    # bench/results/rapid_models/; part of a tuned profile's key.
    rapid_models: RapidModels = "v6-small"
    # Fold the Chinese punctuation the recogniser reads in Latin text to ASCII ("（GST）：" to
    # "(GST):", a dash read as "一" to "-"), where the letters around it are not CJK
    # (ocrq/models/rapid/punctuation.py). Empty means on; off keeps the recogniser's characters,
    # for CJK text with Latin words in it.
    rapid_latin_punctuation: bool = True

    @field_validator("rapid_latin_punctuation", mode="before")
    @classmethod
    def _on_when_empty(cls, value: object) -> object:
        empty = value is None or (isinstance(value, str) and not value.strip())
        return True if empty else value

    @field_validator("rapid_models", mode="before")
    @classmethod
    def _default_when_empty(cls, value: object) -> object:
        empty = value is None or (isinstance(value, str) and not value.strip())
        return "v6-small" if empty else value


class ModelSettings(BudgetSettings):
    """The model an engine serves, the same for each of the HunyuanOCR engines (ocrq's own,
    in-process vLLM, an OpenAI-compatible server): the base of their groups."""

    # HunyuanOCR, whichever engine serves it. The repository's root holds 1.5 (since July
    # 2026); "v1.0" is the older model. Which version a checkpoint is comes from its
    # config.json (ocrq/models/hunyuan/versions.py).
    model: str = "tencent/HunyuanOCR"
    model_revision: str | None = None
    model_subfolder: str | None = None
    # Tokens generated at most per image; with the prompt it sizes the KV cache.
    max_new_tokens: int = Field(default=1024, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    # Per-task cap on the pixels the model sees, over the engine's defaults
    # (ocrq/models/hunyuan/resolution.py), e.g. "parse=2359296,spotting=4194304"; the task names of
    # ocrq.core.contract.TASKS, or "custom" for free prompts. The model's own limit always applies.
    task_max_pixels: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    # The model's weights and activations (in-process engines): a torch dtype, or "auto"
    # (bfloat16 on CUDA, else float32). Device "auto": cuda:0 when torch sees CUDA, else the
    # CPU; or e.g. "cuda:1".
    dtype: str = "bfloat16"
    device: str = "auto"
    # Static batches or the running loop (continuous batching; the fast loop only).
    # "auto": the running loop where its Triton attention runs (CUDA), static batches elsewhere
    # (on a CPU the loop's torch attention reads the whole KV pool every step: slower).
    scheduler: Scheduler = "auto"

    @field_validator("task_max_pixels", mode="before")
    @classmethod
    def _split_task_pixels(cls, value: object) -> object:
        if isinstance(value, str):
            pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError("OCRQ_TASK_MAX_PIXELS takes task=pixels pairs: parse=2359296,...")
            value = {k.strip(): v.strip() for k, v in pairs}
        return value

    @field_validator("task_max_pixels")
    @classmethod
    def _check_task_pixels(cls, value: dict[str, int]) -> dict[str, int]:
        from ocrq.core.contract import MAX_PIXELS_RANGE, TASKS

        unknown = sorted(set(value) - {*TASKS, "custom"})
        if unknown:
            raise ValueError(f"OCRQ_TASK_MAX_PIXELS: unknown tasks {unknown}")
        low, high = MAX_PIXELS_RANGE
        bad = sorted(k for k, v in value.items() if not low <= v <= high)
        if bad:
            raise ValueError(f"OCRQ_TASK_MAX_PIXELS: {bad} outside {low}..{high} pixels")
        return value


class HunyuanSettings(ModelSettings, HunyuanLabSettings):
    """OCRQ_ENGINE=hunyuan: ocrq's own HunyuanOCR engine (ocrq/models/hunyuan). Its kernels,
    numerics and the running loop's schedule are lab levers (`HunyuanLabSettings`), inherited
    here so that the engine reads every one of its settings from this group."""

    # HunyuanOCR in ocrq's own engine (OCRQ_ENGINE=hunyuan).
    # Prompt tokens a prefill chunk of the running loop holds (OCRQ_PREFILL_SCHEDULE=chunked, the
    # default), packed; their activations are reserved in the memory budget. 16,384, a pass at
    # most every 4 decode steps: fewer, fuller passes, whose host cost is paid per pass (on an
    # H200 1.06x the images/s of 4,096 and every step, GPU busy 97% instead of 95%:
    # bench/results/service_gpu/service_gpu_reading.md, run 16). Its reserve is 2.5 GiB of
    # activations instead of 0.6: lower it on a small GPU to keep the KV pool.
    prefill_chunk_tokens: int = Field(default=16384, ge=256, le=1_048_576)
    # The interactive lane inside the running loop (ocrq/models/loop/lane_pass.py;
    # docs/internals.md).
    # Slots added to the loop that only interactive rows take, so one is prefilled in the next
    # pass however full of bulk rows the loop is; bulk keeps its OCRQ_MAX_BATCH slots. 8: the
    # H200 run's stream (2/s, ~1 s each alone) had ~2 live at once, 8 takes bursts of 4x that;
    # a slot's state is ~8 bytes per new token, and the step widens past OCRQ_MAX_BATCH only
    # while an interactive row holds a slot above the bulk ones (with
    # OCRQ_INTERACTIVE_EXTRA_STEPS they are the lowest slots instead: a full loop's step then
    # runs over all of them). 0: no reserve.
    interactive_slots: int = Field(default=8, ge=0, le=1024)
    # While an interactive row is live: decode steps after each full one over only the smallest
    # graphed bucket of slots holding every live interactive row (the reserve, the lowest
    # slots), so such a row makes up to 1 + this many tokens per full step instead of one
    # (a small step ~2 ms on an H200 against ~9 ms for a full loop's; bulk rows below that
    # bucket get the tokens too). Above 0 the reserved slots are the loop's lowest, bulk rows
    # take those above; an interactive row that finds the reserve full gets no such steps.
    # 4: on an H200 with a bulk backlog the interactive p95 was 2.6x its latency alone (6.8x
    # with 0) and the backlog ran at 0.75x its rate alone while the stream lasted (0.88x with
    # 0; bench/results/lanes/README.md). 0: none, for bulk throughput first.
    interactive_extra_steps: int = Field(default=4, ge=0, le=64)
    # Seconds the running loop may spend warming up before the worker is ready, on a GPU: a
    # made-up row through it (kernels compiled on first use, FlashAttention-4's ~3 s included)
    # and every decode bucket's CUDA graph captured, which its first jobs would otherwise wait
    # for while the GPU idles (ocrq/models/hunyuan/warm_up.py). A bucket not captured by then is
    # captured on its first use. 0: no warm-up.
    warmup_s: float = Field(default=60.0, ge=0, le=3600)


class VllmSettings(ModelSettings):
    """OCRQ_ENGINE=vllm: HunyuanOCR in vLLM, in the worker's process (ocrq/models/vllm)."""

    # vLLM in the worker (OCRQ_ENGINE=vllm; docs/engines.md).
    # Sequences in flight and tokens per scheduler step (vLLM's own knobs); the context a
    # sequence may take (None: the version's largest image + prompt + new tokens).
    vllm_max_num_seqs: int = Field(default=256, ge=1, le=65_536)
    vllm_max_num_batched_tokens: int = Field(default=16_384, ge=256, le=1_048_576)
    vllm_max_model_len: int | None = Field(default=None, ge=64, le=1_048_576)


class OpenAISettings(ModelSettings):
    """OCRQ_ENGINE=openai: HunyuanOCR behind an OpenAI-compatible server (ocrq/models/openai)."""

    # Remote HunyuanOCR (OCRQ_ENGINE=openai; docs/engines.md): an OpenAI-compatible server
    # (`vllm serve` of HunyuanOCR), e.g. http://gpu-1:8000/v1; the served model's name is
    # OCRQ_MODEL, its version OPENAI_VERSION.
    openai_url: str | None = None
    openai_api_key: SecretStr | None = None
    openai_version: Literal["1.0", "1.5"] = "1.5"
    openai_concurrency: int = Field(default=16, ge=1, le=4096)  # requests in flight per worker
    # One attempt, from sending the request to the answer's last byte (not per read).
    openai_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    # Largest answer read: a completion of 131,072 tokens, escaped, is a few MB.
    openai_max_response_bytes: int = Field(default=16 * 2**20, ge=1024, le=2**31)
    # How long connection errors and 5xx answers are retried (with backoff) before the job fails.
    openai_retry_s: float = Field(default=600.0, ge=0, le=86_400)

