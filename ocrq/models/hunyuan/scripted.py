"""Bench-only: end each row of a random-weight checkpoint at a length the bench drew.

Why: random weights never emit an end-of-sequence token, so without this every row of a
service benchmark runs to `OCRQ_MAX_NEW_TOKENS` and the workload loses what makes it real
(a word crop ends after a few tokens, a dense page after a thousand). The bench writes a table
(job id -> new tokens) beside the checkpoint; the fast loop then chooses the checkpoint's eos
as the row's token at that step, exactly where a trained model would stop, so the row ends as
finished (no `truncated`) and the memory plan still budgets the full `max_new_tokens`.

Why production cannot reach it: the table is read only from a checkpoint whose config.json
carries `RANDOM_MARK`, which only ocrq's random-weight builder (ocrq/testing/tiny_hunyuan.py)
writes; no setting or job field names it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

RANDOM_MARK = "ocrq_random_weights"  # config.json key the random builder sets
TABLE_NAME = "ocrq_scripted_lengths.json"  # {job id: new tokens including the eos}


def is_random_checkpoint(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get(RANDOM_MARK))


def scripted_lengths(model_dir: Path | None) -> dict[str, int]:
    """The table of a random-weight checkpoint (empty for any other, or without a table)."""
    if model_dir is None or not (model_dir / TABLE_NAME).is_file():
        return {}
    if not is_random_checkpoint(model_dir):
        log.warning("%s ignored: %s is not a random-weight checkpoint", TABLE_NAME, model_dir)
        return {}
    table = json.loads((model_dir / TABLE_NAME).read_text())
    lengths = {str(k): int(v) for k, v in table.items() if int(v) >= 1}
    log.warning(
        "bench mode: %d rows of this random-weight checkpoint end at scripted lengths (%s)",
        len(lengths),
        TABLE_NAME,
    )
    return lengths


def write_table(model_dir: Path, lengths: dict[str, int]) -> Path:
    path = model_dir / TABLE_NAME
    path.write_text(json.dumps(lengths))
    return path
