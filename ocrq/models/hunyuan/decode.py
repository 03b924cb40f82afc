"""A lean greedy decode loop for HunYuanVL: one prefill through the model, then graphed steps.

Why not `model.generate()`: its decode step costs ~70-90 ms on an H200 at every batch size, all
of it host time (Python, a DynamicCache that grows by `torch.cat`, per-step masks, logits
processors, a host sync per step); the memory-bandwidth floor of that step is ~4 ms at batch 128.
This loop keeps the model's own vision tower and attention arithmetic, takes the multimodal RoPE
positions each row brings from the engine's preprocessing, runs the text prefill with fused
norm/RoPE kernels when the step does (ocrq/models/hunyuan/prefill.py), and replaces the decode
steps:

* the prefill's KV cache moves layer by layer into a static cache sized prompt + new tokens,
  so the peak stays the prefill's until that cache outgrows it (ocrq/models/costs.py);
* after the prompt every RoPE axis carries the same text position, so each row's position is its
  last prompt position + 1 + step, advanced on the device (no recomputation of mrope indices);
* a step calls the model's own submodules (norms, projections, MLP, lm_head) with the same
  float arithmetic as transformers for RoPE, so outputs match the plain path; attention reads
  each row's real keys once (ocrq/models/hunyuan/attention.py);
* greedy argmax, the repetition penalty (a gather/scatter over each row's token history), the
  min-new-tokens eos ban, finished rows forced to pad, the step counters: all on the device, so
  one step is captured in a CUDA graph per batch and replayed with no host sync except a check
  for "all rows finished" every `CHECK_EVERY` steps;
* between replays, every `guard.every` steps, the repetition guard finds looping rows on the
  device and finishes them (ocrq/models/hunyuan/repetition.py); `generate()` stops the same rows at
  the same token counts.

A graph is captured per batch rather than cached across batches: the KV cache it points at is
then allocated and freed with its batch, as the planner's memory model assumes, and a capture
costs one step's host time (tens of ms) against hundreds of replayed steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.attention import (
    DEFAULT_CONFIG,
    KernelConfig,
    TritonDecodeAttention,
    attend_torch,
    triton_available,
)
from ocrq.models.hunyuan.generation import ATTENTION_MODES, unsupported_reason
from ocrq.models.hunyuan.prefill import DecodeState, prefill
from ocrq.models.hunyuan.repetition import LoopFinder, guard_due, penalise
from ocrq.models.hunyuan.text import TextModel
from ocrq.models.hunyuan.tokens import SpecialTokens
from ocrq.models.hunyuan.versions import RepetitionGuard

if TYPE_CHECKING:
    import torch

CHECK_EVERY = 16  # steps between host checks for "every row has finished"

log = logging.getLogger(__name__)


@dataclass
class DecodeStats:
    """Where one batch's time went (seconds), and how its steps ran."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    steps: int = 0  # decode steps run after the prefill (new tokens - 1 unless all finished)
    timed_steps: int = 0  # steps inside decode_s (a graph's first step runs within capture_s)
    graph: bool = False
    attention: str = "torch"
    fused: bool = False
    cache_len: int = 0
    prefill_peak_bytes: int = 0  # device memory allocated at most up to the prefill's end (CUDA)


@dataclass
class Decoded:
    """One batch's fast-loop output (CPU tensors)."""

    tokens: torch.Tensor  # (B, steps) generated ids, pad after a row's end
    logits: torch.Tensor | None  # (B, steps, V) raw float32 logits, when asked
    scores: torch.Tensor | None  # (B, steps, V) what each token was chosen from, when asked
    stopped: torch.Tensor  # (B,) tokens kept by a row the repetition guard stopped, else 0
    stats: DecodeStats


class HunyuanDecoder:
    """The fast decode path for one loaded HunYuanVLForConditionalGeneration."""

    def __init__(
        self,
        model: Any,
        *,
        use_graph: bool | None = None,
        attention: str = "auto",
        fused: bool | None = None,
        kernel: KernelConfig = DEFAULT_CONFIG,
    ) -> None:
        """`fused` (default: with Triton attention) replaces transformers' RMSNorm and RoPE
        modules by the kernels of ocrq/models/hunyuan/kernels.py in the prefill and the step."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, not {attention!r}")
        self.model = model
        self.text = TextModel(model)
        self.device = model.device
        self.is_cuda = self.device.type == "cuda"
        self.use_graph = self.is_cuda if use_graph is None else use_graph
        if attention == "auto":
            attention = "triton" if self.is_cuda and triton_available() else "torch"
        self.attention = attention
        self.fused = attention == "triton" if fused is None else fused
        self.kernel = kernel
        if self.fused:  # now, not in a first step the memory plan did not count (text.py)
            self.text.merge()

    # -- one batch ---------------------------------------------------------------------------

    def generate(
        self,
        inputs: dict[str, torch.Tensor],
        tokens: SpecialTokens,
        *,
        max_new_tokens: int,
        min_new_tokens: int | None = None,
        output_logits: bool = False,
        repetition_penalty: float = 1.0,
        guard: RepetitionGuard | None = None,
        eos_at: Sequence[int | None] | None = None,
    ) -> Decoded:
        """Greedy tokens (B, steps) on the CPU, raw logits and the scores chosen from
        (B, steps, V) if asked, which rows the repetition guard stopped, and stats.

        `inputs` are the collated model inputs on the model's device; `tokens` says which ids
        end a row and what finished rows are padded with. `repetition_penalty` is transformers'
        (ocrq/models/hunyuan/repetition.py); `guard` stops rows whose tail loops (None: never).
        `eos_at` (a bench's hooks only, ocrq/models/hunyuan/hooks.py): per row, the index of the
        new token it takes as eos, or None for the model's own choice; None, the service's,
        adds nothing to the steps.
        """
        import torch

        stats = DecodeStats(attention=self.attention, fused=self.fused)
        n_new = max_new_tokens
        min_new = min_new_tokens or 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            state, first_logits = self._prefill(inputs, tokens, n_new, repetition_penalty)
            if eos_at is not None and any(n is not None for n in eos_at):
                state.eos_at = torch.tensor(
                    [n_new if n is None else n for n in eos_at],
                    dtype=torch.long,
                    device=state.out.device,
                )
            if output_logits:
                state.logits, state.scores = [], []
            self._choose_first(state, first_logits, min_new)
            del first_logits
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
                stats.prefill_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            t1 = time.perf_counter()
            stats.prefill_s = t1 - t0
            stats.cache_len = int(state.keys[0].shape[2]) if state.keys else 0
            finder = LoopFinder(guard, self.device) if guard is not None else None
            steps = self._decode(state, n_new, min_new, output_logits, stats, finder)
            new = state.out[:, : steps + 1].cpu()
            stats.steps = steps
            stats.decode_s = time.perf_counter() - t1 - stats.capture_s
            logits = torch.stack(state.logits, dim=1).cpu() if state.logits else None
            scores = torch.stack(state.scores, dim=1).cpu() if state.scores else None
            assert state.stopped is not None
            stopped = state.stopped.cpu()
        return Decoded(new, logits, scores, stopped, stats)

    def _prefill(
        self,
        inputs: dict[str, torch.Tensor],
        tokens: SpecialTokens,
        n_new: int,
        penalty: float = 1.0,
    ) -> tuple[DecodeState, torch.Tensor]:
        """The prompt pass and the state the steps start from (ocrq/models/hunyuan/prefill.py)."""
        return prefill(self.text, inputs, tokens, n_new, fused=self.fused, penalty=penalty)

    def _contiguous_rows(self, state: DecodeState, prompt: int) -> bool:
        """True when every row's real keys are one run ending at the prompt's end (left padding),
        the layout the Triton kernel assumes; anything else takes the torch attention."""
        real = state.valid[:, :prompt].sum(-1)
        return bool(((prompt - state.start.long()) == real).all())

    def _choose_first(self, state: DecodeState, logits: torch.Tensor, min_new: int) -> None:
        nxt = self._select(logits, state, min_new)
        state.out[:, 0] = nxt
        state.finished |= (nxt[:, None] == state.eos[None, :]).any(1)
        state.tok.copy_(nxt)
        state.kidx += 1

    def _scores(self, logits: torch.Tensor, state: DecodeState, min_new: int) -> torch.Tensor:
        """The scores a token is chosen from, as transformers' logits processors make them:
        float32, the repetition penalty over each row's history, eos banned before min_new."""
        import torch

        scores = logits.float()
        if state.history is not None:
            scores = penalise(scores, state.history, state.penalty)
        if min_new > 0:
            banned = state.kidx < min_new  # (1,) bool, stays on the device
            eos_scores = scores.index_select(1, state.eos)
            scores = scores.index_copy(
                1,
                state.eos,
                torch.where(banned, torch.full_like(eos_scores, float("-inf")), eos_scores),
            )
        return scores

    def _select(self, logits: torch.Tensor, state: DecodeState, min_new: int) -> torch.Tensor:
        """Greedy choice as transformers makes it; finished rows get pad. Records the logits and
        scores when kept, and the choice in the rows' history."""
        import torch

        scores = self._scores(logits, state, min_new)
        if state.logits is not None and state.scores is not None:
            state.logits.append(logits.float())
            state.scores.append(scores)
        nxt = scores.argmax(-1)
        if state.eos_at is not None:  # hooks only: their rows end here
            nxt = torch.where(state.eos_at == state.kidx, state.eos[0].expand_as(nxt), nxt)
        nxt = torch.where(state.finished, torch.full_like(nxt, state.pad), nxt)
        if state.history is not None and state.hidx is not None:
            state.history.index_copy_(1, state.hidx, nxt[:, None])
            state.hidx += 1
        return nxt

    def _guard(self, state: DecodeState, finder: LoopFinder, n: int) -> None:
        """Stop the running rows whose first `n` tokens end in a loop: they finish now, keeping
        those `n` tokens (their later ones are pad), and `stopped` says so. On the device, no
        host sync: the loop's own all-finished check sees them."""
        import torch

        assert state.stopped is not None
        newly = finder(state.out[:, :n]) & ~state.finished
        if state.eos_at is not None:  # hooks only: such a row's length is the hooks' call
            newly &= state.eos_at >= state.out.shape[1]
        state.stopped.copy_(torch.where(newly, n, state.stopped))
        state.finished |= newly

    def _decode(
        self,
        state: DecodeState,
        n_new: int,
        min_new: int,
        keep_logits: bool,
        stats: DecodeStats,
        finder: LoopFinder | None = None,
    ) -> int:
        """Run decode steps 1..n_new-1 (step j feeds token j-1 and produces token j); before a
        step, with `done` steps run, `done + 1` tokens exist, which the guard checks when due."""
        import torch

        guard = finder.guard if finder is not None else None
        total = n_new - 1
        if total <= 0:
            return 0
        attend = self._attention_fn(state, state.prompt)
        graph = self.use_graph and self.is_cuda and not keep_logits and total >= 2
        stats.graph = graph
        state.full_cache = graph
        if not graph:
            for done in range(total):
                if finder is not None and guard_due(guard, done + 1, min_new, n_new):
                    self._guard(state, finder, done + 1)
                if done % CHECK_EVERY == 0 and done and bool(state.finished.all()):
                    stats.timed_steps = done
                    return done
                self._step(state, attend, min_new)
            stats.timed_steps = total
            return total

        t = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(state, attend, min_new)  # step 1, eagerly: also warms up the kernels
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            self._step(state, attend, min_new)  # recorded, not run
        torch.cuda.synchronize(self.device)
        stats.capture_s = time.perf_counter() - t
        done = 1
        while done < total:
            if finder is not None and guard_due(guard, done + 1, min_new, n_new):
                self._guard(state, finder, done + 1)
            if done % CHECK_EVERY == 0 and bool(state.finished.all()):
                break
            g.replay()
            done += 1
        torch.cuda.synchronize(self.device)
        del g
        stats.timed_steps = done - 1
        return done

    def _attention_fn(self, state: DecodeState, prompt: int) -> Any:
        if self.attention == "triton" and self._contiguous_rows(state, prompt):
            state.track_valid = False
            kernel = TritonDecodeAttention(
                state.out.shape[0],
                self.text.heads,
                self.text.kv_heads,
                self.text.head_dim,
                state.keys[0].shape[2],
                self.device,
                self.kernel,
            )

            def triton_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return kernel(q, k, v, state.start, state.end, self.text.scale)

            return triton_attend

        def torch_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if state.full_cache:
                return attend_torch(q, k, v, state.valid, self.text.scale)
            n = state.host_len
            return attend_torch(q, k[:, :, :n], v[:, :, :n], state.valid[:, :n], self.text.scale)

        return torch_attend

    def _step(self, state: DecodeState, attend: Any, min_new: int) -> None:
        """One decode step over the static state; no host sync, no data-dependent Python."""
        if state.track_valid:
            state.valid.index_fill_(1, state.slot, True)
        logits = self.text.step(
            state.tok, state.pos, state.slot, state.keys, state.values, attend, self.fused
        )
        nxt = self._select(logits, state, min_new)
        state.out.index_copy_(1, state.kidx, nxt[:, None])
        state.finished |= (nxt[:, None] == state.eos[None, :]).any(1)
        state.tok.copy_(nxt)
        state.pos += 1
        state.slot += 1
        state.end += 1
        state.kidx += 1
        state.host_len += 1


def fast_decoder(
    model: Any, generation_config: Any, attention: str = "auto"
) -> HunyuanDecoder | None:
    """The fast loop for a loaded model with that decode attention (`Settings.decode_attention`),
    or None when the checkpoint's generation config asks for what only `generate()` does."""
    why_not = unsupported_reason(generation_config)
    if why_not:
        log.warning(
            "fast decode cannot honour %s in the generation config; using generate()", why_not
        )
        return None
    return HunyuanDecoder(model, attention=attention)
