"""The running loop (ocrq/models/hunyuan/running.py) on the tiny HunyuanOCR 1.5, on the CPU.

A row admitted mid-flight, into a slot and a KV range another row has just left, must make the
same tokens AND the same per-step logits as that row alone through the static fast loop (a
tiny random model emits near-identical tokens for every image, so tokens alone could not fail:
ARCHITECTURE.md). The check is shown to fail when a slot's old keys stay visible: `LeakyLoop`
skips the per-slot clear at admission, and the reused row's logits then move by far more than
the tolerance. Rows of very different lengths (their own caps, eos banned so each runs exactly
to it) all complete in both prefill schedules, with fewer slots than rows and a pool too small
for all of them at once.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from ocrq.models.base import PreparedImage
from ocrq.models.hunyuan import HunyuanLoopEngine
from ocrq.models.hunyuan.loop_types import LoopRow
from ocrq.models.hunyuan.readback import Readback, Snapshot
from ocrq.models.hunyuan.runner import LoopRunner
from ocrq.models.hunyuan.running import RunningLoop
from ocrq.models.slots import RunningBudget
from tests.tiny_hunyuan import cpu_settings, item, tiny_checkpoint

pytestmark = pytest.mark.hunyuan

MAX_NEW = 24
TOLERANCE = 1e-3  # fp32 on the CPU: the loops differ by ~5e-6 (see test_hunyuan_decode)


class LeakyLoop(LoopRunner):
    """Does not clear a slot's key mask when a new row takes it: the old row's keys leak in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tensors.forget_keys = lambda slot: None  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HunyuanLoopEngine:
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "1.5")
    eng = HunyuanLoopEngine(cpu_settings(str(path), MAX_NEW), decode="fast")
    eng.load()
    assert eng.repetition_penalty == 1.08  # the penalty's per-row state is exercised too
    return eng


def budget(slots: int, pool_tokens: int) -> RunningBudget:
    return RunningBudget(slots, pool_tokens, 4096, 0, 0, 0, 0)


def make_loop(engine: HunyuanLoopEngine, slots: int, pool: int, cls: type = LoopRunner,
              **extra: Any) -> RunningLoop:
    assert engine._decoder is not None and engine.tokens is not None
    config = engine.loop_config(budget(slots, pool), **extra)
    return RunningLoop(engine._decoder, engine.tokens, config, runner=cls)


def rows(engine: HunyuanLoopEngine, items: list[PreparedImage], caps: list[int],
         forced: bool = False) -> list[LoopRow]:
    return [
        LoopRow(it.key, engine.preprocess(it), cap, min_new_tokens=cap if forced else 0)
        for it, cap in zip(items, caps, strict=True)
    ]


# Row 0 (the largest image) leaves after 3 tokens; row 2 (small) then takes its slot and the
# start of its KV range, so the old row's columns beyond the new prompt are stale.
ITEMS = [item(160, 150, 1), item(100, 90, 2, task="spotting"), item(64, 64, 3), item(300, 40, 4)]
CAPS = [3, MAX_NEW, 12, 16]


@pytest.fixture(scope="module")
def alone(engine: HunyuanLoopEngine) -> dict[str, Any]:
    """Each row alone through the static fast loop, with its logits."""
    return {
        it.key: engine.generate([it], max_new_tokens=cap, output_logits=True).items[0]
        for it, cap in zip(ITEMS, CAPS, strict=True)
    }


def run_mid_flight(engine: HunyuanLoopEngine, cls: type = LoopRunner) -> dict[str, Any]:
    loop = make_loop(engine, 2, 1024, cls, keep_logits=True)
    loop.add(rows(engine, ITEMS, CAPS))
    done = {d.row.key: d for d in loop.drain()}
    assert loop.idle() and loop.pool.free_tokens == 1024  # every range given back
    return done


def test_a_row_admitted_mid_flight_equals_the_row_alone(
    engine: HunyuanLoopEngine, alone: dict[str, Any]
) -> None:
    done = run_mid_flight(engine)
    assert set(done) == {it.key for it in ITEMS}
    # Rows 2 and 3 joined while row 1 was decoding, in slot 0 where row 0 had been.
    assert done["img3"].row.slot == 0 and done["img4"].row.slot == 0
    assert done["img1"].row.start == done["img3"].row.start == 0
    for key, want in alone.items():
        got = done[key]
        generated = engine.finish(got)
        assert generated.token_ids == want.token_ids and generated.truncated == want.truncated
        assert got.logits.shape == want.logits.shape
        assert float((got.logits - want.logits).abs().max()) < TOLERANCE, key
    # Different images differ by far more than the tolerance: the comparison can fail.
    assert float((alone["img1"].logits[0] - alone["img3"].logits[0]).abs().max()) > 0.1


def test_a_slots_old_keys_leaking_in_is_caught(
    engine: HunyuanLoopEngine, alone: dict[str, Any]
) -> None:
    done = run_mid_flight(engine, LeakyLoop)
    # The first two rows took fresh slots: untouched by the mutation.
    for key in ("img1", "img2"):
        assert float((done[key].logits - alone[key].logits).abs().max()) < TOLERANCE
    # The rows that reused slot 0 see the old row's keys.
    for key in ("img3", "img4"):
        diff = done[key].logits - alone[key].logits
        assert float(diff.abs().max()) > 100 * TOLERANCE, key


@pytest.mark.parametrize("schedule", ["alternate", "chunked"])
def test_rows_of_very_different_lengths_all_complete(
    engine: HunyuanLoopEngine, schedule: str
) -> None:
    caps = [1, MAX_NEW, 2, 17, 5, MAX_NEW, 3, 9]
    items = [item(64 + 12 * i, 64 + 20 * (i % 3), 40 + i) for i in range(len(caps))]
    batch = rows(engine, items, caps, forced=True)
    biggest = max(r.prompt_tokens for r in batch) + MAX_NEW
    # 3 slots, and a pool that holds about two of the longest rows at once.
    loop = make_loop(engine, 3, 2 * biggest + 32, schedule=schedule, chunk_tokens=256)
    loop.add(batch)
    finished_order = []
    results = {}
    while not loop.idle():
        for d in loop.run():
            finished_order.append(d.row.key)
            results[d.row.key] = d
    assert sorted(results) == sorted(it.key for it in items)
    for it, cap in zip(items, caps, strict=True):
        assert len(results[it.key].tokens) == cap, it.key
        assert engine.finish(results[it.key]).truncated == "max_tokens"
    # Short rows left before the long ones that started with them ended.
    assert finished_order.index("img40") < finished_order.index("img41")
    assert loop.stats.prefills >= 2 and loop.stats.row_steps <= loop.stats.slot_steps
    assert loop.pool.free_tokens == loop.config.pool_tokens


def test_an_fp8_pool_stores_fp8_and_stays_close_to_the_models_dtype(
    engine: HunyuanLoopEngine, alone: dict[str, Any]
) -> None:
    """The mid-flight rows with `kv_dtype="fp8"`: the pool holds fp8, each row's logits stay
    near the full-precision rows' (the tiny model's logits spread over ~2), and they are not
    equal to them: the keys and values really went through fp8."""
    import torch

    loop = make_loop(engine, 2, 1024, keep_logits=True, kv_dtype="fp8")
    pool = loop.runner.tensors
    assert all(k.dtype == torch.float8_e4m3fn for k in pool.keys + pool.values)
    loop.add(rows(engine, ITEMS, CAPS))
    done = {d.row.key: d for d in loop.drain()}
    assert loop.pool.free_tokens == 1024
    moved = 0.0
    for key, want in alone.items():
        got = done[key]
        steps = 1  # compare up to the first token that differs (then the inputs differ)
        while steps < len(got.tokens) and got.tokens[steps - 1] == want.token_ids[steps - 1]:
            steps += 1
        diff = float((got.logits[:steps] - want.logits[:steps]).abs().max())
        assert diff < 0.5 * float(want.logits.std()), key
        moved = max(moved, diff)
    assert moved > 1e-4


def test_an_fp8_pool_halves_the_loops_token_bytes(engine: HunyuanLoopEngine) -> None:
    """The budget charges a pool token in the pool's dtype (the CPU model is float32: a
    quarter), so the same bytes hold more rows; the static path's model is untouched."""
    from ocrq.models.costs import CostModel

    model = CostModel(10 * 2**20, per_token_bytes=4096.0, per_cache_token_bytes=8192.0)
    try:
        engine.settings = engine.settings.model_copy(update={"kv_cache_dtype": "fp8"})
        fp8 = engine.loop_cost_model(model)
        assert engine.loop_config(budget(2, 64)).kv_dtype == "fp8"
    finally:
        engine.settings = engine.settings.model_copy(update={"kv_cache_dtype": "auto"})
    assert fp8.per_cache_token_bytes == 8192.0 / 4 and fp8.per_token_bytes == 4096.0
    assert engine.loop_cost_model(model) is model
    wide = RunningBudget.plan(model, 2**30, slots=4, prefill_tokens=256)
    narrow = RunningBudget.plan(fp8, 2**30, slots=4, prefill_tokens=256)
    assert narrow.pool_tokens >= 3.9 * wide.pool_tokens


def run_packed(engine: HunyuanLoopEngine, packed: bool) -> dict[str, Any]:
    """Rows of different prompt lengths, several a pass (a 4,096-token chunk), tokens forced."""
    caps = [6, 9, 4, 7, 5]
    items = [item(64 + 24 * i, 64 + 16 * (i % 2), 60 + i, task="spotting" if i == 2 else "text")
             for i in range(len(caps))]
    loop = make_loop(engine, 4, 2048, keep_logits=True, packed=packed, chunk_tokens=4096)
    loop.add(rows(engine, items, caps, forced=True))
    done = {d.row.key: d for d in loop.drain()}
    assert loop.pool.free_tokens == 2048
    return {"done": done, "prefills": loop.stats.prefills}


def test_packed_prefill_equals_the_padded_one(engine: HunyuanLoopEngine) -> None:
    """The same rows through packed passes (no padding, causal varlen attention) and padded
    ones: the same tokens, logits within the loops' tolerance. Prompts differ in length, so a
    padded pass pads; a packed one does not."""
    padded, packed = run_packed(engine, False), run_packed(engine, True)
    assert packed["prefills"] <= padded["prefills"]
    assert set(packed["done"]) == set(padded["done"])
    lengths = {d.row.prompt_tokens for d in packed["done"].values()}
    assert len(lengths) > 1
    for key, want in padded["done"].items():
        got = packed["done"][key]
        assert got.tokens == want.tokens, key
        assert float((got.logits - want.logits).abs().max()) < TOLERANCE, key


def test_packed_rows_attending_across_their_bounds_is_caught(
    engine: HunyuanLoopEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounds that join the first two rows (row 2 then sees row 1's tokens) move row 2's
    logits: the equality above can fail."""
    import torch

    from ocrq.models.hunyuan import packed as packed_module

    real_pack = packed_module.pack

    def joined(*args: Any, **kwargs: Any) -> Any:
        batch = real_pack(*args, **kwargs)
        if batch.last.numel() > 1:
            batch.edges = batch.edges[:1] + batch.edges[2:]
            batch.bounds = torch.tensor(batch.edges, dtype=torch.int32)
        return batch

    want = run_packed(engine, True)["done"]
    monkeypatch.setattr("ocrq.models.hunyuan.passes.pack", joined)
    got = run_packed(engine, True)["done"]
    moved = max(float((got[k].logits - want[k].logits).abs().max()) for k in want)
    assert moved > 100 * TOLERANCE


def test_packed_admission_counts_tokens_not_rows_times_the_longest() -> None:
    from ocrq.models.slots import Candidate, KvPool, admit

    waiting = [Candidate("a", 1000, 1100), Candidate("b", 100, 200), Candidate("c", 100, 200)]
    pool = KvPool.empty(10_000)
    padded = admit(waiting, pool, [0, 1, 2], 1500)
    packed = admit(waiting, pool, [0, 1, 2], 1500, packed=True)
    assert [p.key for p in padded.placements] == ["a"]  # 2 x 1000 > 1500
    assert [p.key for p in packed.placements] == ["a", "b", "c"]  # 1200 <= 1500
    assert len(admit(waiting, pool, [0, 1, 2], 1150, packed=True).placements) == 2


def test_per_row_cap_comes_from_the_item(engine: HunyuanLoopEngine) -> None:
    it = item(64, 64, 7)
    it.max_new_tokens = 5
    assert engine.row_cap(it) == 5
    assert engine.estimate(it).new_tokens == 5
    it.max_new_tokens = 10 * MAX_NEW
    assert engine.row_cap(it) == MAX_NEW


def test_engine_streams_rows_through_submit_and_poll(engine: HunyuanLoopEngine) -> None:
    from ocrq.models.base import OcrResult
    from ocrq.models.costs import CostModel

    per_token = engine.cost_model().per_cache_token_bytes  # the tiny model's KV per token
    model = CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token)
    engine.open(2**24, model)
    running = engine.running
    assert running is not None and running.pool_tokens > 1000
    assert running.bytes <= 2**24 and running.pool_bytes >= running.pool_tokens * per_token
    items = [item(64, 64, 50), item(100, 100, 51), item(64, 64, 52)]
    items[0].max_new_tokens = 2
    engine.submit(items)
    # handed over, not yet admitted: the batcher's records count them as waiting, not in flight
    assert engine.queued() == 3
    got: dict[str, Any] = {}
    while len(got) < 3:
        for f in engine.poll(1.0):
            got[f.key] = f.resolve()
            assert f.started_at is not None  # row-seconds count from the row's admission
    assert all(isinstance(r, OcrResult) for r in got.values())
    assert engine.queued() == 0
    static = engine.run([items[1]])[0]
    assert got["img51"] == static
    # The loop's totals for the worker's metrics survive a reopened loop (an OOM recovery).
    before = engine.loop_counts()
    assert before["steps"] > 0 and before["prefilled_rows"] == 3
    engine.reset()
    engine.open(2**24, model)
    engine.submit([item(64, 64, 53)])
    while not engine.poll(1.0):
        pass
    after = engine.loop_counts()
    assert after["prefilled_rows"] == 4 and after["steps"] > before["steps"]
    engine.reset()


class ForgetfulLoop(LoopRunner):
    """Reads a late copy of the slots' state as if today's rows had held the slots then: a row
    admitted into a slot that was free when the copy was queued looks finished."""

    def _ended(self, snap: Snapshot) -> list[Any]:
        snap.rows = {s: self.rows[s] for s in range(len(snap.finished)) if s in self.rows}
        return super()._ended(snap)


def lagged_run(engine: HunyuanLoopEngine, lag: int,
               cls: type = LoopRunner) -> dict[str, list[int]]:
    caps = [1, MAX_NEW, 2, 17, 5, MAX_NEW, 3, 9, 4, 11]
    items = [item(64 + 12 * i, 64 + 20 * (i % 3), 60 + i) for i in range(len(caps))]
    batch = rows(engine, items, caps, forced=True)
    biggest = max(r.prompt_tokens for r in batch) + MAX_NEW
    loop = make_loop(engine, 3, 2 * biggest + 32, cls, schedule="chunked", chunk_tokens=256,
                     check_every=2)
    loop.runner.state.readback = Readback(3, MAX_NEW, loop.runner.device, lag=lag)
    loop.add(batch)
    got: dict[str, list[int]] = {}
    for d in loop.drain():
        assert d.row.key not in got, "a row handed back twice"
        got[d.row.key] = d.tokens
    assert loop.pool.free_tokens == loop.config.pool_tokens
    assert {k: len(v) for k, v in got.items()} == {
        it.key: cap for it, cap in zip(items, caps, strict=True)
    }
    return got


@pytest.mark.parametrize("lag", [1, 3])
def test_rows_read_from_late_copies_are_the_rows_that_finished(
    engine: HunyuanLoopEngine, lag: int
) -> None:
    """The GPU's policy on the CPU: the slots' state is read some steps after it was copied,
    while freed slots take new rows; every row still comes back once, whole, with the tokens
    the synchronous loop gives it."""
    assert lagged_run(engine, lag) == lagged_run(engine, 0)
    with pytest.raises(AssertionError):
        lagged_run(engine, lag, ForgetfulLoop)


def test_host_layout_puts_image_features_where_the_mask_would(engine: HunyuanLoopEngine) -> None:
    """The running loop's prefill places image features by indices the host computed (no
    device mask, no sync): for rows of different lengths, left-padded, exactly the places
    transformers' masked_scatter fills; right padding's places differ (the check can fail)."""
    import torch

    from ocrq.models.hunyuan.inputs import collate, host_layout

    encoded = [engine.preprocess(it) for it in (item(160, 150, 1), item(64, 64, 3),
                                                 item(300, 40, 4))]
    image_id = int(engine.model.model.config.image_token_id)
    host = host_layout(encoded, image_id, "cpu")
    assert host.padded and host.grid.device.type == "cpu" and host.grid.shape == (3, 3)

    def placed(side: str) -> torch.Tensor:
        ids = collate(encoded, engine.tokens.pad, padding_side=side)["input_ids"]
        h = torch.zeros(*ids.shape, 4)
        return h.masked_scatter((ids == image_id)[..., None].expand_as(h), feats)

    count = int(sum(int((e.input_ids == image_id).sum()) for e in encoded))
    feats = torch.randn(count, 4)
    want = placed("left")
    got = torch.zeros(want.shape[0] * want.shape[1], 4).index_copy_(0, host.image_at, feats)
    assert torch.equal(got.reshape(want.shape), want)
    assert not torch.equal(got.reshape(want.shape), placed("right"))


def test_a_prefill_gap_makes_fewer_passes_and_the_same_tokens(engine: HunyuanLoopEngine) -> None:
    """OCRQ_PREFILL_GAP_STEPS: freed slots are refilled every few steps, in fewer, fuller
    passes; each row still makes exactly its tokens."""

    def run(gap: int) -> tuple[dict[str, list[int]], int]:
        caps = [2, 9, 3, 14, 2, 5, 3, 7, 2, 4, 6, 3]
        items = [item(64 + 8 * i, 64 + 16 * (i % 3), 80 + i) for i in range(len(caps))]
        loop = make_loop(engine, 4, 4096, schedule="chunked", chunk_tokens=4096,
                         prefill_gap=gap, check_every=1)
        loop.add(rows(engine, items, caps, forced=True))
        got = {d.row.key: d.tokens for d in loop.drain()}
        assert {k: len(v) for k, v in got.items()} == {
            it.key: cap for it, cap in zip(items, caps, strict=True)
        }
        return got, loop.stats.prefills

    every, passes = run(1)
    gapped, fewer = run(6)
    assert gapped == every
    assert fewer < passes, (fewer, passes)


class OomWhenFull(HunyuanLoopEngine):
    """The loop raises torch's OutOfMemoryError once, the first time it holds more than two rows:
    a CUDA out-of-memory error cannot happen on a CPU, so this stands in for one."""

    raised = 0

    def poll(self, timeout_s: float) -> list[Any]:
        import torch

        if not self.raised and self.loop is not None and self.loop.live > 2:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return super().poll(timeout_s)


def test_an_oom_in_the_loop_requeues_its_rows_and_lowers_the_budget(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """StreamingBatcher's recovery: the rows in flight go back to the queue, the loop reopens
    within a lower budget, and every job still gets the result it gets without the error. The
    loop keeps the batcher's lane rule, opened and reopened (one bound: OCRQ_BULK_MAX_WAIT_S)."""
    from ocrq.core.lanes import LaneRule
    from ocrq.models.costs import CostModel
    from ocrq.scheduling.streaming import StreamingBatcher
    from ocrq.scheduling.vocabulary import BatchConfig

    path = tiny_checkpoint(tmp_path_factory.mktemp("oom"), "1.5")
    engine = OomWhenFull(cpu_settings(str(path), MAX_NEW), decode="fast")
    engine.load()
    per_token = engine.cost_model().per_cache_token_bytes
    model = CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token)
    items = [item(64 + 8 * i, 64, 90 + i) for i in range(5)]
    for it, cap in zip(items, (2, MAX_NEW, 20, 16, 12), strict=True):
        it.max_new_tokens = cap  # the first ends early: the loop still holds the others
    engine.raised = 1  # the reference: the same rows through the loop without the error
    engine.open(2**24, model)
    assert engine.loop is not None and engine.loop.config.lanes.bulk_max_wait_s == 30.0
    engine.submit(items)
    want: dict[str, Any] = {}
    while len(want) < len(items):
        want.update((f.key, f.resolve()) for f in engine.poll(1.0))
    engine.reset()
    engine.raised = 0
    config = BatchConfig(max_items=4, budget_bytes=2**24, lanes=LaneRule(7.0))
    batcher = StreamingBatcher(engine, config, None, model)
    assert engine.loop is not None and engine.loop.config.lanes.bulk_max_wait_s == 7.0
    configured = batcher.budget_bytes
    batcher.start()
    since = "ocrq_batch_running_since_timestamp_seconds"
    try:
        futures = {it.key: batcher.submit(it) for it in items}
        # Liveness reads this gauge: set while rows are in the loop, cleared once none are.
        seen = []
        while not all(f.done() for f in futures.values()):
            seen.append(REGISTRY.get_sample_value(since) or 0.0)
            time.sleep(0.005)
        got = {key: f.result(timeout=120) for key, f in futures.items()}
        deadline = time.monotonic() + 10
        while REGISTRY.get_sample_value(since) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        batcher.stop(30)
    assert max(seen) > 0 and REGISTRY.get_sample_value(since) == 0
    assert engine.raised == 1 and batcher.oom_events == 1
    assert batcher.budget_bytes < configured
    assert all(o.error is None for o in got.values()), got
    assert {key: o.result for key, o in got.items()} == want
    assert engine.loop.config.lanes.bulk_max_wait_s == 7.0  # the reopened loop's too
    engine.reset()


def test_static_batches_honour_each_jobs_cap(engine: HunyuanLoopEngine) -> None:
    """A job's own max_new_tokens holds in a static batch too (the planner budgets its KV for
    it): the batch runs to its largest cap and cuts each row at its own, as a run to that cap
    would end it; the same results as the running loop's, which stops each row there."""
    from ocrq.models.costs import CostModel

    items = [item(64 + 8 * i, 64, 120 + i) for i in range(3)]
    for it, cap in zip(items, (3, 9, 5), strict=True):
        it.max_new_tokens = cap
    static = dict(zip((it.key for it in items), engine.run(items), strict=True))
    assert [static[it.key].truncated for it in items] == ["max_tokens"] * 3
    per_token = engine.cost_model().per_cache_token_bytes
    engine.open(2**24, CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token))
    engine.submit(items)
    looped: dict[str, Any] = {}
    while len(looped) < len(items):
        looped.update((f.key, f.resolve()) for f in engine.poll(1.0))
    engine.reset()
    assert looped == static
    # Each row is cut exactly at its own cap (not at the engine's MAX_NEW), as if run alone.
    rows = engine.generate(items).items
    assert [len(r.token_ids) for r in rows] == [3, 9, 5]
    alone = engine.generate([items[2]], max_new_tokens=5).items[0]
    assert rows[2].token_ids == alone.token_ids and rows[2].text == alone.text


def test_flash_varlen_only_where_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed attention takes torch's flash kernel on Ampere and newer only; a T4 or a V100
    (capability 7.x) and a head size it cannot take fall back to SDPA per row. There is no GPU
    here, so the queries are a stand-in with a tensor's attributes."""
    from types import SimpleNamespace

    import torch

    from ocrq.models.hunyuan import packed

    def queries(dtype: Any = torch.bfloat16, dim: int = 128) -> Any:
        return SimpleNamespace(is_cuda=True, dtype=dtype, shape=(10, 16, dim),
                               device=SimpleNamespace(index=0))

    assert not packed.flash_varlen_ok(torch.zeros(4, 2, 8, dtype=torch.bfloat16))  # the CPU
    monkeypatch.setattr(packed, "_capability", lambda index: (9, 0))
    assert packed.flash_varlen_ok(queries())
    assert not packed.flash_varlen_ok(queries(torch.float32))
    assert not packed.flash_varlen_ok(queries(dim=72 + 4))
    assert not packed.flash_varlen_ok(queries(dim=512))
    monkeypatch.setattr(packed, "_capability", lambda index: (7, 5))
    assert not packed.flash_varlen_ok(queries())


def test_a_cancelled_row_leaves_the_loop_at_the_next_harvest(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """Batcher.cancel on a row the loop is decoding: its future resolves Cancelled long before
    its cap, its slot and KV range go back, and the loop serves the next row as if the dropped
    one had finished (the same result as on a fresh loop). At stop the batcher logs the loop's
    totals with its two levels (bench/lanes.py reads them), both 0 once everything ended."""
    from ocrq.models.costs import CostModel
    from ocrq.scheduling.streaming import StreamingBatcher
    from ocrq.scheduling.vocabulary import BatchConfig, Cancelled

    cap = 4000
    path = tiny_checkpoint(tmp_path_factory.mktemp("cancel"), "1.5")
    engine = HunyuanLoopEngine(cpu_settings(str(path), cap), decode="fast")
    engine.load()
    per_token = engine.cost_model().per_cache_token_bytes
    model = CostModel(0, per_token_bytes=100.0, per_cache_token_bytes=per_token)
    long, short = item(64, 64, 7), item(72, 64, 8)
    short.max_new_tokens = 3
    engine.open(2**26, model)
    engine.submit([short])
    want = None
    while want is None:
        want = next((f.resolve() for f in engine.poll(1.0)), None)
    engine.reset()
    batcher = StreamingBatcher(engine, BatchConfig(max_items=4, budget_bytes=2**26), None, model)
    batcher.start()
    try:
        doomed = batcher.submit(long)
        deadline = time.monotonic() + 120
        while not (engine.loop is not None and engine.loop.rows) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.loop is not None and engine.loop.rows, "the long row never entered the loop"
        batcher.cancel({long.key})
        dropped = doomed.result(timeout=60)
        assert isinstance(dropped.error, Cancelled) and dropped.result is None
        assert engine.loop.stats.steps < cap and not engine.loop.rows
        assert engine.loop.pool == type(engine.loop.pool).empty(engine.loop.config.pool_tokens)
        got = batcher.submit(short).result(timeout=120)
    finally:
        with caplog.at_level(logging.INFO, logger="ocrq.scheduling.streaming"):
            batcher.stop(30)
    assert got.error is None and got.result == want
    totals = [json.loads(r.getMessage().split("running loop totals: ", 1)[1])
              for r in caplog.records if "running loop totals: " in r.getMessage()]
    assert totals and totals[-1]["steps"] > 0
    assert totals[-1]["waiting_now"] == 0 and totals[-1]["held_now"] == 0
    engine.reset()
