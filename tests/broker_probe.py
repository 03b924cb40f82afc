"""Where a stuck job's message is, for a fault test's timeout message.

A fault test that times out with a row still `queued` says little by itself: the recovery sweep
(ocrq/core/requeue.py) leaves a message alone when it sees it in a queue's list or in kombu's
`unacked` under a live holder, and re-sends a row only when its message is nowhere and the row
is among the queued rows it checks (`workers_table.queued_before`: the oldest and newest of
each lane). This reads the same places the sweep reads, through the same
BrokerView, and says for each id which one holds it.
"""

from __future__ import annotations

import time

from sqlalchemy import func, select

from ocrq.core import workers_table
from ocrq.core.broker_scan import broker_view
from ocrq.core.db import get_engine, ocr_workers
from ocrq.core.requeue import LOST_CANDIDATES, producer_app, queue_of
from ocrq.core.settings import Settings


def where(settings: Settings, job_ids: list[str]) -> str:
    """One line per id: in a list, in `unacked` (holder, its heartbeat age, taken how long ago),
    or nowhere; then whether the lost sweep checks each id's row."""
    if not job_ids:
        return "broker: no ids asked"
    engine = get_engine(settings.database_url)
    app = producer_app(settings)
    lines = []
    with broker_view(app, queue_of(settings)) as view:
        if view is None:
            return "broker: not Redis"
        listed, whole = view.queued(job_ids, None)
        held = {h.job_id: h for h in view.held() if h.job_id in job_ids}
        taken = view.delivered_at([h.tag for h in held.values()])
        with engine.connect() as conn:
            beats = {
                name: at
                for name, at in conn.execute(select(ocr_workers.c.name, ocr_workers.c.heartbeat_at))
            }
            now = conn.execute(select(func.now())).scalar_one()
        for job_id in job_ids:
            if job_id in listed:
                lines.append(f"{job_id}: in a queue's list")
            elif job_id in held:
                h = held[job_id]
                beat = beats.get(h.worker or "")
                age = f"{(now - beat).total_seconds():.1f} s" if beat else "no heartbeat row"
                since = taken.get(h.tag)
                took = f"{time.time() - since:.1f} s ago" if since else "not in the index"
                lines.append(
                    f"{job_id}: unacked tag {h.tag}, holder {h.worker!r} (heartbeat {age}), "
                    f"taken {took}"
                )
            else:
                lines.append(f"{job_id}: nowhere in Redis (lists read whole: {whole})")
    older = workers_table.queued_before(engine, 5.0, None)
    checked = {r.id for r in workers_table.queued_before(engine, 5.0, LOST_CANDIDATES)}
    lines.append(
        f"queued rows older than 5 s: {len(older)}; among those the lost sweep checks: "
        + ", ".join(f"{j[:8]}={'yes' if j in checked else 'no'}" for j in job_ids)
    )
    return "\n".join(lines)
