"""HunyuanOCR through its running loop (continuous batching): the static engine plus the loop.

Why a class of its own: the worker drives a `StreamingEngine` through `open`, `submit` and `poll`
(ocrq/scheduling/streaming.py), a static `Engine` through `run`; one class that was both had to
be asked at every call site which it was this time. Here the loop adapter extends the static
engine (ocrq/models/hunyuan/engine.py: loading, planning, preprocessing, `run` for the tests
and the tuner that still call it) with the loop's sizing, its warm-up, its rows in and out,
and its account; the registry (ocrq/models/registry.py) builds this class where `runs_loop`
says the worker's rows go through the loop, the static engine elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from ocrq.core.contract import INTERACTIVE
from ocrq.core.lanes import DEFAULT_LANES, LaneRule
from ocrq.core.process import STATE
from ocrq.core.settings import HunyuanSettings
from ocrq.models.base import Finished, PreparedImage, StreamingEngine
from ocrq.models.costs import CostModel
from ocrq.models.hunyuan.engine import HunyuanEngine
from ocrq.models.hunyuan.generation import generated_rows
from ocrq.models.hunyuan.hooks import DecodeHooks
from ocrq.models.hunyuan.inputs import EncodedImage
from ocrq.models.hunyuan.kv_cache import bytes_ratio
from ocrq.models.hunyuan.loop_types import Done, LoopConfig, LoopRow
from ocrq.models.hunyuan.output import result_of
from ocrq.models.hunyuan.running import RunningLoop
from ocrq.models.loop.lane_pass import LanePolicy
from ocrq.models.slots import RunningBudget, capacity_of

log = logging.getLogger(__name__)

WARM_UP_KEY = "ocrq-warm-up"  # the made-up row of the running loop's warm-up (`warm_up`)


def runs_loop(settings: HunyuanSettings) -> bool:
    """Whether a worker with these settings runs its rows through the running loop
    (OCRQ_SCHEDULER): "continuous" on the fast decode path; "auto" where the loop's decode
    attention is Triton's (OCRQ_DECODE_ATTENTION=triton, or "auto" on a CUDA device with Triton
    installed); never "static", nor with OCRQ_DECODE=generate. Asked once, before loading."""
    if settings.scheduler == "static" or settings.decode != "fast":
        return False
    if settings.scheduler == "continuous":
        return True
    if settings.decode_attention != "auto":
        return settings.decode_attention == "triton"
    try:
        import torch
    except ImportError:  # no torch: the engine cannot load anyway, and says so there
        return False
    from ocrq.models.hunyuan.attention import triton_available

    wanted = settings.device
    cuda = wanted.startswith("cuda") or (wanted == "auto" and torch.cuda.is_available())
    return cuda and triton_available()


class HunyuanLoopEngine(HunyuanEngine, StreamingEngine):
    """HunyuanOCR whose worker's rows run in the running loop (ocrq/models/hunyuan/running.py)."""

    def __init__(
        self,
        settings: HunyuanSettings,
        *,
        decode: str | None = None,
        hooks: DecodeHooks | None = None,
    ) -> None:
        """As `HunyuanEngine`'s; the loop runs on the fast decode path only."""
        super().__init__(settings, decode=decode, hooks=hooks)
        if self.decode != "fast":
            raise ValueError("the running loop runs on the fast decode path (OCRQ_DECODE=fast), "
                             f"not {self.decode!r}")
        # The running loop, once `open` has sized it.
        self.loop: RunningLoop | None = None
        self._banked: dict[str, float] = {}  # `loop_counts` of the loops already dropped
        self.running: RunningBudget | None = None
        # The batcher's lane rule (`open`): OCRQ_BULK_MAX_WAIT_S bounds a bulk row's wait in the
        # loop as in the batcher (the engine's settings group does not hold it).
        self.lanes = DEFAULT_LANES
        self._items: dict[str, PreparedImage] = {}  # rows in the loop, by key
        self._failed: list[Finished] = []  # rows that failed before reaching the loop
        # The checkpoint ruled the fast decode path out (`load`): static batches, no loop.
        self._static_only = False

    @classmethod
    def from_settings(cls, settings: HunyuanSettings) -> HunyuanLoopEngine:
        return cls(settings)

    def load(self) -> None:
        """As `HunyuanEngine.load`. A checkpoint whose generation config only `generate()`
        honours (ocrq/models/hunyuan/generation.py) cannot run the loop: with
        OCRQ_SCHEDULER=continuous, asked for by name, that stops the worker here, at start; with
        "auto" the engine runs static batches, as before the two classes were split
        (`streams`), the warning above saying why."""
        super().load()
        self._static_only = self._decoder is None
        if self._static_only and self.settings.scheduler == "continuous":
            raise RuntimeError(
                "the running loop needs the fast decode path, which this checkpoint's "
                "generation config rules out (the warning above says why): set "
                "OCRQ_SCHEDULER=static"
            )

    def streams(self) -> bool:
        """False once `load` found the fast decode path ruled out ("auto"): the worker then
        runs this engine's static batches (`run`, the static engine's)."""
        return not self._static_only

    def close(self) -> None:
        self._drop_loop()
        super().close()

    def take_tuned_max_batch(self, max_batch: int) -> None:
        """The running loop's slots follow the tuned knee unless OCRQ_MAX_BATCH is set (`open`)."""
        if self.settings.max_batch is None:
            self.settings = self.settings.model_copy(update={"max_batch": max_batch})

    def state_bytes_per_slot(self) -> int:
        """Device bytes each slot's state holds beside the pool: its output tokens, its
        repetition-penalty mask (one bool per vocabulary id) and, for the torch attention, its
        key mask (the pool's width is not known yet: charged by the pool tokens instead)."""
        vocab = int(self.model.lm_head.weight.shape[0]) if self.model is not None else 120818
        seen = vocab if self.repetition_penalty != 1.0 else 0
        return 8 * self.settings.max_new_tokens + seen + 64

    def open(
        self, budget_bytes: int, model: CostModel, lanes: LaneRule = DEFAULT_LANES
    ) -> RunningBudget:
        """Size the running loop (slots = OCRQ_MAX_BATCH, else `preferred_max_batch`) within
        `budget_bytes` above the fixed part, and allocate its KV pool now; its rows ordered by
        the batcher's `lanes` (kept for `loop_config`)."""
        if self._decoder is None or self.tokens is None:
            raise RuntimeError("HunyuanLoopEngine.load() must run before open()")
        s = self.settings
        # Bulk rows keep their OCRQ_MAX_BATCH slots; the interactive lane's are on top.
        slots = (s.max_batch or self.preferred_max_batch()) + s.interactive_slots
        model = self.loop_cost_model(model)
        budget = RunningBudget.plan(
            model,
            budget_bytes,
            slots=slots,
            prefill_tokens=self.pass_tokens(),
            state_bytes_per_slot=self.state_bytes_per_slot(),
        )
        budget = replace(budget, reserved_slots=s.interactive_slots)
        # The torch attention also keeps a key mask per slot: a byte per slot and pool token.
        mask_bytes = 0 if self._decoder.attention == "triton" else slots
        per_token = model.per_cache_token_bytes + mask_bytes
        if mask_bytes:
            budget = replace(budget, pool_tokens=int(budget.pool_bytes // per_token) // 16 * 16)
        # No more than every slot could hold at once (a host's memory as budget is far more).
        most = budget.slots * capacity_of(budget.prefill_tokens, s.max_new_tokens)
        if budget.pool_tokens > most:
            budget = replace(budget, pool_tokens=most, pool_bytes=int(most * per_token))
        self.lanes = lanes
        if self.loop is not None:  # reopened (after an OOM): the old loop's memory back first
            self._drop_loop()
            self.release_memory()  # a full gc.collect(): ~0.5 s with torch loaded, on a CPU
        self.loop = RunningLoop(
            self._decoder, self.tokens, self.loop_config(budget), hooks=self.hooks
        )
        self.running = budget
        log.info(
            "running loop: %d slots (%d interactive only), KV pool of %d tokens (%.2f GiB), "
            "prefill %s up to %d tokens",
            budget.slots,
            budget.reserved_slots,
            budget.pool_tokens,
            budget.pool_bytes / 2**30,
            s.prefill_schedule,
            s.prefill_tokens if s.prefill_schedule == "alternate" else s.prefill_chunk_tokens,
        )
        return budget

    def warm_up(self) -> None:
        """Before the loop's first job, on a GPU: a made-up row through it and every decode
        bucket captured, within OCRQ_WARMUP_S (ocrq/models/hunyuan/warm_up.py says why).
        Nothing on a CPU, where nothing is compiled or captured on first use. A warm-up that
        fails is logged and the loop goes on empty: its jobs then do what it did not."""
        s = self.settings
        if self.loop is None or not self._cuda() or s.warmup_s <= 0:
            return
        from PIL import Image

        timeline = STATE.timeline
        started = time.monotonic()
        deadline = started + s.warmup_s
        item = PreparedImage(key=WARM_UP_KEY, image=Image.new("RGB", (64, 64), "white"),
                             original_size=(64, 64))
        try:
            with timeline.phase("warm-up: a row through the loop"):
                self.prepare(item)
                assert isinstance(item.encoded, EncodedImage)
                row = LoopRow(item.key, item.encoded, min(2, s.max_new_tokens))
                self.loop.warm_up(row, deadline)
            with timeline.phase("warm-up: decode graphs"):
                graphed = self.loop.warm_up(None, deadline)
        except Exception:
            log.warning("running loop warm-up failed; its first jobs compile and capture "
                        "instead", exc_info=True)
            self.loop.clear()
            return
        log.info(
            "running loop warmed up in %.1f s: decode graphs for %s slots%s",
            time.monotonic() - started, graphed,
            "" if time.monotonic() < deadline else f" (OCRQ_WARMUP_S={s.warmup_s:g} reached)",
        )

    def loop_cost_model(self, model: CostModel) -> CostModel:
        """`model` with a pool token in the loop's KV dtype (`OCRQ_KV_CACHE_DTYPE`): the cost
        model is measured with the model's dtype, and only the running loop's pool changes."""
        import torch

        dtype = (self.model.dtype if self.model is not None
                 else getattr(torch, self.settings.dtype, torch.bfloat16))
        ratio = bytes_ratio(self.settings.kv_cache_dtype, dtype)
        if ratio == 1.0:
            return model
        return replace(model, per_cache_token_bytes=model.per_cache_token_bytes * ratio)

    def loop_config(self, budget: RunningBudget, **overrides: Any) -> LoopConfig:
        s = self.settings
        values: dict[str, Any] = {
            "slots": budget.slots,
            "pool_tokens": budget.pool_tokens,
            "max_new_tokens": s.max_new_tokens,
            "schedule": s.prefill_schedule,
            "prefill_tokens": s.prefill_tokens,
            "chunk_tokens": s.prefill_chunk_tokens,
            "prefill_gap": s.prefill_gap_steps,
            "penalty": self.repetition_penalty,
            "guard": self.version.guard,
            "kv_dtype": s.kv_cache_dtype,
            "fp8_products": s.kv_fp8_products,
            "packed": s.prefill_packed,
            "prefill_stream": s.prefill_stream,
            "fused_step_rows": s.loop_fused_step_rows,
            "min_bucket": s.loop_min_bucket,
            "lanes": LanePolicy.of(s, budget.reserved_slots, self.lanes.bulk_max_wait_s),
        }
        values.update(overrides)
        return LoopConfig(**values)

    def submit(self, rows: Sequence[PreparedImage]) -> None:
        """Queue rows to the running loop (preprocessed in the prefetch threads already, else
        here); a row the processor refuses comes back from the next `poll` as its error."""
        if self.loop is None:
            raise RuntimeError("HunyuanLoopEngine.open() must run before submit()")
        queued = []
        for item in rows:
            encoded = self._preprocess_or_error(item)
            if isinstance(encoded, Exception):
                self._failed.append(Finished(item.key, encoded))
                continue
            queued.append(
                LoopRow(item.key, encoded, self.row_cap(item),
                        interactive=item.priority == INTERACTIVE)
            )
            self._items[item.key] = item
        try:
            self.loop.add(queued)
        except ValueError as exc:  # over the pool alone: the planner should have said so
            for row in queued:
                self._items.pop(row.key, None)
                self._failed.append(Finished(row.key, exc))

    def poll(self, timeout_s: float) -> list[Finished]:
        """Run the loop until a row finishes or `timeout_s` passes; the rows finished."""
        out, self._failed = self._failed, []
        if self.loop is None or self.loop.idle():
            return out
        done = self.loop.run(timeout_s)
        return out + [self._finished(d) for d in done]

    def drop(self, keys: Collection[str]) -> list[str]:
        """Cancelled rows out of the loop (RunningLoop.drop), their slots and KV freed."""
        if self.loop is None:
            return []
        dropped = [row.key for row in self.loop.drop(keys)]
        for key in dropped:
            self._items.pop(key, None)
        return dropped

    def finish(self, done: Done) -> Any:
        """A finished loop row as `generate` returns rows (a `Generated`)."""
        import torch

        assert self.tokens is not None
        new = torch.tensor([done.tokens], dtype=torch.long)
        logits = done.logits[None] if done.logits is not None else None
        return generated_rows(
            new,
            logits,
            self.tokens,
            self.processor,
            [done.row.prompt_tokens],
            stopped=torch.tensor([done.stopped]),
        )[0]

    def _finished(self, done: Done) -> Finished:
        """Detokenising and parsing wait for `Finished.resolve`, called off the loop's thread."""
        item = self._items.pop(done.row.key)
        prompts = self.version.prompts
        return Finished(
            item.key,
            None,
            lambda: result_of(item, self.finish(done), prompts),
            started_at=done.row.admitted_at,
        )

    def queued(self) -> int:
        return 0 if self.loop is None else self.loop.scheduler.waiting

    def loop_counts(self) -> dict[str, float]:
        """The running loop's `LoopStats` as totals over every loop this engine opened."""
        now = self._loop_stats()
        return {k: self._banked.get(k, 0.0) + now.get(k, 0.0) for k in {*self._banked, *now}}

    def _loop_stats(self) -> dict[str, float]:
        return {} if self.loop is None else self.loop.stats.metrics()

    def _drop_loop(self) -> None:
        """Forget the loop, its totals kept for `loop_counts` (a reopened loop counts on)."""
        self._banked = self.loop_counts()
        self.loop = None

    def reset(self) -> list[str]:
        """Drop the loop and its rows (after an out-of-memory error); their keys."""
        keys = list(self._items)
        self._items.clear()
        if self.loop is not None:
            self.loop.clear()
        self._drop_loop()
        self.release_memory()
        return keys

