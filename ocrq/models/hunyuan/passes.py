"""The running loop's prefill passes: admitted rows' prompts into their slots and KV ranges.

Why apart from the runner: a pass carries out the admissions of the scheduler's plan
(ocrq/models/loop/scheduler.py `StepPlan.admit`) on the device state the runner
(ocrq/models/hunyuan/runner.py) keeps and its decode steps read: the rows go into the slots
and KV ranges the plan gave them, their prompts run through the model in one pass (left-padded,
or packed end to end: ocrq/models/hunyuan/packed.py), each layer's keys and values go into the
rows' ranges of the pool, every per-slot tensor takes the rows' values, and the runner chooses
each row's first token as the static loop would.

A pass is a launch (the rows into their slots and ranges, the model writing their prompts' KV)
and a commit (every per-slot tensor, the loop's books, the first tokens). With
`LoopConfig.prefill_stream` on a GPU the launch runs on a side stream and the commit waits for
the first loop iteration that finds it done, so decode steps overlap the pass (docs/engines.md).
A decode step reads and writes only live rows' ranges, the scratch column and the per-slot
tensors over all its slots; the launch writes none of those, so the two may run side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.inputs import collate, host_layout
from ocrq.models.hunyuan.kv_cache import store
from ocrq.models.hunyuan.packed import pack, prefill_packed
from ocrq.models.hunyuan.prefill import prompt_pass
from ocrq.models.hunyuan.readback import to_device

if TYPE_CHECKING:
    import torch

    from ocrq.models.hunyuan.harvest import Harvest
    from ocrq.models.hunyuan.loop_state import LoopParts
    from ocrq.models.hunyuan.loop_types import LoopRow


@dataclass
class PendingPass:
    """A pass launched and not yet committed: its rows hold their slots and KV ranges but are
    not live (their slots' state is as the last row left it: finished, scratch column)."""

    rows: list[LoopRow]
    busy: bool  # launched while the interactive lane was busy
    first_logits: Any = None
    next_pos: Any = None
    marks: Any = None
    event: Any = None  # recorded on the side stream after the pass's work (a GPU only)
    looks: int = 0  # loop iterations that found it not done


def _event_done(pending: PendingPass) -> bool:
    return pending.event is None or bool(pending.event.query())


class PrefillPasses:
    """One runner's prefill passes; `run` takes the rows a plan admitted this tick.

    A pass is a launch and a commit. The launch puts the rows into their slots and ranges and
    runs the model, which writes only the rows' own KV ranges; the commit
    writes every per-slot tensor a decode step reads or updates, makes the rows live and
    chooses their first tokens. Without `LoopConfig.prefill_stream` the commit follows the
    launch at once, on the loop's stream. With it, on a GPU, the launch runs on a side stream of
    low priority while the loop's decode steps go on (a memory-bound step overlaps the
    compute-bound pass), and the loop commits the pass at the first iteration that finds it
    done (`land`): nothing a step touches is written on the side stream."""

    def __init__(self, state: LoopParts, harvest: Harvest) -> None:
        """`harvest`: told of each row a commit makes live (when its cap is reached)."""
        self.state = state
        self.harvest = harvest
        self.pending: PendingPass | None = None
        # Whether a launched pass is done (CUDA: its event, queried without a sync). Tests
        # replace it, or set `hold`: iterations a deferred pass stays pending whatever it says.
        self.done: Callable[[PendingPass], bool] = _event_done
        self.hold = 0
        self.side: Any = None  # the side stream (a GPU with `prefill_stream`), set by the loop

    @property
    def deferred(self) -> bool:
        return self.state.config.prefill_stream

    def slots(self) -> set[int]:
        """The slots the pending pass holds (not live, not free)."""
        return {r.slot for r in self.pending.rows} if self.pending is not None else set()

    def run(self, rows: list[LoopRow], busy: bool) -> None:
        """The pass of `rows` (their slots and ranges set, in pass order), its GPU time on the
        lane's span while the interactive lane is `busy` (an interactive row live or waiting
        when it was planned: ocrq/models/loop/lane_pass.py), so its rows' token cost counts the
        passes run between their steps. Committed at once unless deferred."""
        state = self.state
        span = "prefill_lane" if busy else "prefill"
        if not self.deferred:
            with state.clock.span(span):
                self._launch(rows, busy)
                self.commit()
        elif self.side is None:  # deferred on a CPU (tests): launched now, committed later
            with state.clock.span(span):
                self._launch(rows, busy)
        else:
            self._launch_on_side(rows, busy, span)
        stats, tokens = state.stats, sum(r.prompt_tokens for r in rows)
        stats.prefills += 1
        stats.prefilled_rows += len(rows)
        stats.prefill_tokens += tokens
        stats.prefilled_interactive += sum(r.interactive for r in rows)
        if busy:
            stats.lane_prefills += 1
            stats.lane_prefill_tokens += tokens

    def _launch_on_side(self, rows: list[LoopRow], busy: bool, span: str) -> PendingPass:
        """The launch on the side stream, after the steps queued so far (they may still read
        the ranges just given to these rows); an event marks its end."""
        import torch

        here = torch.cuda.current_stream(self.state.device)
        self.side.wait_stream(here)
        with torch.cuda.stream(self.side), self.state.clock.span(span):
            pending = self._launch(rows, busy)
            pending.event = torch.cuda.Event()
            pending.event.record()
        for t in (pending.first_logits, pending.next_pos, pending.marks):
            if t is not None:  # made on the side stream, read on the loop's at commit
                t.record_stream(here)
        return pending

    def land(self, wait: bool) -> bool:
        """Commit the pending pass if it is done (with `wait`, waiting for it on a GPU);
        whether it was. At most `hold` looks find it not done first (tests)."""
        pending, stats = self.pending, self.state.stats
        assert pending is not None
        if pending.looks < self.hold or not (self.done(pending) or wait):
            pending.looks += 1
            stats.pending_iterations += 1
            return False
        self.commit()
        return True

    def settle(self) -> None:
        """The pending pass committed now (drop: its rows become live rows, to be released as
        any live row is); the loop's stream waits for the pass, the host does not."""
        if self.pending is not None:
            self.commit()

    def discard(self) -> list[LoopRow]:
        """Forget the pending pass (clear): its rows (their slots were never live; their KV
        ranges are the scheduler's to give back)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return []
        if pending.event is not None:
            pending.event.synchronize()  # the pass's work done before its memory is reused
        return pending.rows

    def _launch(self, rows: list[LoopRow], busy: bool) -> PendingPass:
        """The rows into their slots and ranges, their prompts through the model into their
        ranges of the pool. Everything here is queued without a host sync (to_device, index
        lists built on the host): a sync would empty the queue of decode steps behind which it
        runs. The pass is pending from before the model runs, so `clear` finds its rows if the
        model fails."""
        for row in rows:
            row.admitted_at = time.monotonic()
        pending = self.pending = PendingPass(rows, busy)
        prompt = self._prompt_packed if self.state.config.packed else self._prompt_padded
        pending.first_logits, pending.next_pos, pending.marks = prompt(rows)
        return pending

    def commit(self) -> None:
        """The pending pass's rows made live, on the loop's stream: every per-slot tensor takes
        their values (a decode step writes these over all its slots, so only the loop's stream
        may), the host's books take them, and their first tokens are chosen."""
        import torch

        state, pending = self.state, self.pending
        assert pending is not None
        if pending.event is not None:
            torch.cuda.current_stream(state.device).wait_event(pending.event)
        self.pending = None
        if pending.looks:
            state.stats.late_passes += 1
        books, t = state.books, state.tensors
        rows, marks = pending.rows, pending.marks
        for r in rows:
            r.first_step = books.step_no  # its first decode step is the next one
            r.extra = 0
        lengths = [r.prompt_tokens for r in rows]
        dev, long = state.device, torch.long
        slots = to_device([r.slot for r in rows], long, dev)
        starts = to_device([r.start for r in rows], torch.int32, dev)
        plens = to_device(lengths, torch.int32, dev)
        for r, length in zip(rows, lengths, strict=True):
            t.forget_keys(r.slot)
            if t.valid is not None:
                t.valid[r.slot, r.start : r.start + length] = True
        t.base.index_copy_(0, slots, starts)
        t.write.index_copy_(0, slots, (starts + plens).long())
        t.pos.index_copy_(1, slots, pending.next_pos)
        t.count.index_fill_(0, slots, 0)
        t.cap.index_copy_(0, slots, to_device([r.max_new_tokens for r in rows], long, dev))
        t.min_new.index_copy_(0, slots, to_device([r.min_new_tokens for r in rows], long, dev))
        if t.forced is not None:
            t.forced.admit(slots, [r.eos_at for r in rows])
        t.finished.index_fill_(0, slots, False)
        t.stopped.index_fill_(0, slots, 0)
        t.out.index_fill_(0, slots, state.tokens.pad)
        if marks is not None:  # the loop keeps a repetition-penalty mask
            t.seen.index_copy_(0, slots, marks)
        for r in rows:
            books.enter(r)
            self.harvest.track(r)
        t.choose(pending.first_logits, slots, rows)

    def _store_prompt(self, prompt_kv: list[Any], rows: list[LoopRow], tokens: Any) -> None:
        """Each layer's prompt keys and values into the rows' ranges of the pool, freeing the
        layer as soon as it is copied; `tokens` turns a layer's keys or values into (KV heads,
        the rows' prompt tokens in row order, D)."""
        import torch

        t = self.state.tensors
        cols: list[int] = []  # the pool columns, row after row (host arithmetic)
        for r in rows:
            cols.extend(range(r.start, r.start + r.prompt_tokens))
        columns = to_device(cols, torch.long, self.state.device)
        for index in range(len(prompt_kv)):
            k, v = prompt_kv[index]
            store(t.keys[index][0], 1, columns, tokens(k))
            store(t.values[index][0], 1, columns, tokens(v))
            prompt_kv[index] = None  # free the layer now
            del k, v

    def _marks(self, n: int) -> torch.Tensor | None:
        """An empty (rows, vocab) repetition-penalty mask, when the loop keeps one."""
        import torch

        seen = self.state.tensors.seen
        if seen is None:
            return None
        return torch.zeros(n, seen.shape[1], dtype=torch.bool, device=self.state.device)

    def _prompt_padded(self, rows: list[LoopRow]) -> tuple[Any, Any, Any]:
        """The rows' prompts through one left-padded pass; their keys and values into their
        ranges. Returns the first tokens' logits, each row's next RoPE position (axes, rows)
        and its repetition-penalty marks (rows, vocab) or None."""
        import torch

        state = self.state
        text, dev = state.decoder.text, state.device
        inputs = collate([r.encoded for r in rows], state.tokens.pad, device=dev, dtype=text.dtype)
        positions = inputs.pop("position_ids", None)
        if positions is None:
            positions, _ = text.model.model.get_rope_index(
                inputs["input_ids"],
                mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"),
                attention_mask=inputs["attention_mask"],
            )
        host = None  # only the fused prefill takes it
        if state.decoder.fused:
            image_id = text.model.model.config.image_token_id
            host = host_layout([r.encoded for r in rows], image_id, dev)
        prompt_kv, first_logits = prompt_pass(text, inputs, positions, state.decoder.fused, host)
        mask = inputs["attention_mask"].bool()
        # Where each row's real tokens sit in the left-padded (B x P) prompt, flattened:
        # host arithmetic, not a boolean index (a sync per layer).
        width = int(inputs["input_ids"].shape[1])
        real: list[int] = []
        for i, r in enumerate(rows):
            real.extend(range(i * width + width - r.prompt_tokens, (i + 1) * width))
        real_at = to_device(real, torch.long, dev)

        def real_tokens(x: torch.Tensor) -> torch.Tensor:
            # (B, KVH, P, D) -> (KVH, B * P, D) -> the real tokens of every row, in row order
            heads, dim = x.shape[1], x.shape[3]
            return x.permute(1, 0, 2, 3).reshape(heads, -1, dim).index_select(1, real_at)

        self._store_prompt(prompt_kv, rows, real_tokens)
        marks = self._marks(len(rows))
        if marks is not None:
            ids = inputs["input_ids"]
            marks.scatter_(1, torch.where(mask, ids, ids.gather(1, mask.int().argmax(-1)[:, None])),
                           True)
        return first_logits, positions[:, :, -1] + 1, marks

    def _prompt_packed(self, rows: list[LoopRow]) -> tuple[Any, Any, Any]:
        """`_prompt_padded` with the rows packed end to end (ocrq/models/hunyuan/packed.py)."""
        state = self.state
        text = state.decoder.text
        batch = pack([r.encoded for r in rows], text.model.model.config.image_token_id,
                     state.device, text.dtype)
        prompt_kv, first_logits = prefill_packed(text, batch, state.decoder.fused)
        self._store_prompt(prompt_kv, rows, lambda x: x)  # packed: already the rows' order
        marks = self._marks(len(rows))
        if marks is not None:
            marks.index_put_((batch.row_of, batch.ids), state.tensors.true)
        return first_logits, batch.positions[:, batch.last] + 1, marks
