"""The running loop's device state: the KV pool and every per-slot tensor, at fixed addresses.

Why a module of its own: the decode steps (ocrq/models/hunyuan/running.py), the prefill passes'
commits (ocrq/models/hunyuan/passes.py) and the harvest's copies (ocrq/models/hunyuan/harvest.py)
all read or write these tensors; held here, each takes them as plain state, and none reaches
into the loop. The layout and why each tensor has a fixed address: the loop's docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.attention import PAD_KEYS
from ocrq.models.hunyuan.greedy import greedy_scores
from ocrq.models.hunyuan.hooks import ForcedEos
from ocrq.models.hunyuan.kv_cache import is_fp8, kv_dtype, padded_width, zero_pool
from ocrq.models.hunyuan.loop_types import LoopConfig, LoopRow
from ocrq.models.hunyuan.tokens import SpecialTokens

if TYPE_CHECKING:
    import torch

    from ocrq.models.hunyuan.text import TextModel

# An fp8 pool's values stored transposed (the loop's docstring). A constant, not a setting:
# bench/service_gpu.py flips it (BENCH_FP8_VALUES) to compare both layouts in one run.
FP8_VALUES_TRANSPOSED = True


class SlotTensors:
    """One loop's pool (one per layer) and per-slot tensors, allocated once, on its device."""

    def __init__(
        self,
        text: TextModel,
        tokens: SpecialTokens,
        config: LoopConfig,
        device: Any,
        *,
        track_valid: bool,
        forced: bool,
    ) -> None:
        """`track_valid`: keep the torch attention's per-slot key mask (the Triton kernel reads
        [start, end) instead). `forced`: keep the hooks' forced-eos state (a bench's)."""
        import torch

        self.config = config
        s, n, dev = config.slots, config.max_new_tokens, device
        self.scratch = config.pool_tokens  # the column every slot without a live row uses
        width = padded_width(config.pool_tokens + 1, PAD_KEYS)
        self.kv_dtype = kv_dtype(config.kv_dtype, text.dtype)
        self.values_transposed = is_fp8(self.kv_dtype) and FP8_VALUES_TRANSPOSED
        heads, dim, kv = text.kv_heads, text.head_dim, self.kv_dtype
        self.keys = [zero_pool(heads, width, dim, kv, dev) for _ in text.layers]
        self.values = [zero_pool(heads, width, dim, kv, dev, transposed=self.values_transposed)
                       for _ in text.layers]
        self.valid = (
            torch.zeros(s, width, dtype=torch.bool, device=dev) if track_valid else None
        )
        long = torch.long
        self.tok = torch.full((s,), tokens.pad, dtype=long, device=dev)
        self.pos = torch.zeros(text.axes, s, dtype=long, device=dev)
        self.write = torch.full((s,), self.scratch, dtype=long, device=dev)
        self.start = torch.full((s,), self.scratch, dtype=torch.int32, device=dev)
        self.end = torch.full((s,), self.scratch + 1, dtype=torch.int32, device=dev)
        self.base = torch.full((s,), self.scratch, dtype=torch.int32, device=dev)
        self.count = torch.zeros(s, dtype=long, device=dev)
        self.cap = torch.ones(s, dtype=long, device=dev)
        self.min_new = torch.zeros(s, dtype=long, device=dev)
        self.finished = torch.ones(s, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(s, dtype=long, device=dev)
        self.out = torch.full((s, n), tokens.pad, dtype=long, device=dev)
        self.eos = torch.tensor(tokens.eos_list, dtype=long, device=dev)
        self.forced = ForcedEos(s, n + 1, self.eos) if forced else None
        vocab = int(text.lm_head.weight.shape[0])
        self.seen = (
            torch.zeros(s, vocab, dtype=torch.bool, device=dev) if config.penalty != 1.0 else None
        )
        self.scratch_col = torch.tensor([self.scratch], dtype=long, device=dev)
        self.true = torch.ones((), dtype=torch.bool, device=dev)
        self.kept: Any = None  # the last step's logits, when the loop keeps them (tests)

    def forget_keys(self, slot: int) -> None:
        """No key of the slot's previous row stays visible to the next one (the torch mask;
        the Triton kernel reads [start, end), reset for the new row)."""
        if self.valid is not None:
            self.valid[slot].fill_(False)

    def free(self, slot: int) -> None:
        """The slot back to its state without a live row: finished, on the scratch column."""
        # fill_ on a slice: `tensor[slot] = value` copies a host scalar, a sync per row.
        self.finished[slot : slot + 1].fill_(True)
        self.write[slot : slot + 1].fill_(self.scratch)
        self.base[slot : slot + 1].fill_(self.scratch)

    def scores(self, logits: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """Float32 scores as transformers' processors make them, for the rows at `slots` (None:
        the first rows, as many as `logits` has)."""
        n = logits.shape[0]
        seen = self.seen if slots is None or self.seen is None else self.seen[slots]
        count = self.count if slots is None else self.count[slots]
        min_new = self.min_new if slots is None else self.min_new[slots]
        return greedy_scores(
            logits, None if seen is None else seen[:n], self.config.penalty, count[:n],
            min_new[:n], self.eos,
        )

    def choose(self, logits: torch.Tensor, slots: torch.Tensor, rows: list[LoopRow]) -> None:
        """The first token of freshly prefilled rows (at `slots`), as the static loop's."""
        scores = self.scores(logits, slots)
        nxt = scores.argmax(-1)
        if self.forced is not None:
            nxt = self.forced.first(nxt, slots)
        if self.config.keep_logits:
            for i, r in enumerate(rows):
                r.logits = [logits[i].float().cpu()]
        self.out[:, 0].index_copy_(0, slots, nxt)
        self.tok.index_copy_(0, slots, nxt)
        ended = (nxt[:, None] == self.eos[None, :]).any(1)
        self.count.index_fill_(0, slots, 1)
        ended |= self.cap[slots] <= 1
        self.finished.index_copy_(0, slots, ended)
        if self.seen is not None:  # a device True: `= True` would copy a host scalar (a sync)
            self.seen.index_put_((slots, nxt), self.true)
