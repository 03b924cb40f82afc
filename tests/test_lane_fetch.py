"""The worker's fetch order (ocrq/worker/lane_fetch.py) on a clock the test moves: interactive
first, the bulk lane fetched every other time once it has waited OCRQ_BULK_MAX_WAIT_S, and back
to interactive first as soon as a lane runs dry. The end-to-end check is in
tests/test_lanes_service.py."""

from __future__ import annotations

from ocrq.worker.lane_fetch import LaneOrder

QUEUES = ["ocr.interactive", "ocr", "celery"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _order(max_wait_s: float = 30.0) -> tuple[LaneOrder, Clock]:
    clock = Clock()
    order = LaneOrder(max_wait_s, clock)
    order.update(list(QUEUES))
    return order, clock


def test_interactive_first_until_bulk_has_waited_the_bound() -> None:
    order, clock = _order()
    for _ in range(5):
        clock.now += 5.0  # 25 s: under the bound
        assert order.consume(3) == QUEUES
        order.rotate("ocr.interactive")
    clock.now += 5.0
    assert order.consume(3) == ["ocr", "celery", "ocr.interactive"]


def test_a_starved_bulk_lane_is_fetched_every_other_time_until_it_runs_dry() -> None:
    order, clock = _order()
    clock.now = 31.0
    seen = []
    for _ in range(3):
        seen.append(order.consume(3)[0])
        order.rotate("ocr")  # bulk first gave bulk
        seen.append(order.consume(3)[0])
        order.rotate("ocr.interactive")
    assert seen == ["ocr", "ocr.interactive"] * 3
    assert order.consume(3)[0] == "ocr"
    order.rotate("ocr.interactive")  # bulk first gave interactive: bulk is empty
    assert [order.consume(3)[0] for _ in range(3)] == ["ocr.interactive"] * 3


def test_no_interactive_message_or_none_at_all_ends_the_promotion() -> None:
    order, clock = _order()
    clock.now = 31.0
    assert order.consume(3)[0] == "ocr"
    order.rotate("ocr")
    assert order.consume(3)[0] == "ocr.interactive"
    order.rotate("ocr")  # interactive first gave bulk: no interactive job waits
    assert [order.consume(3)[0] for _ in range(2)] == ["ocr.interactive"] * 2
    clock.now = 62.0
    assert order.consume(3)[0] == "ocr"
    order.fetched(None)  # nothing at all within the poll
    clock.now = 80.0  # under the bound again, counted from the empty poll
    assert order.consume(3)[0] == "ocr.interactive"
