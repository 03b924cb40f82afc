"""What crosses between the loop's scheduler and its runner: a row asked for, the plan of one
tick, and what the runner did with it.

Why frozen values: the runner executes a plan it cannot change, and the scheduler learns what
happened only from the output it is handed, so either side can be tested alone (vLLM v1's
`SchedulerOutput` / `ModelRunnerOutput` split).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """A row for the loop: its key (the job's), its prompt, its own cap on new tokens (None:
    the loop's), and its lane."""

    key: str
    prompt_tokens: int
    max_new_tokens: int | None = None
    interactive: bool = False


@dataclass(frozen=True)
class Admit:
    """A row to prefill into `slot`, its KV at [start, start + capacity) of the pool; it ends at
    `row_cap` new tokens."""

    key: str
    slot: int
    start: int
    capacity: int
    row_cap: int
    prompt_tokens: int
    interactive: bool


@dataclass(frozen=True)
class StepPlan:
    """One tick: rows to drop first (their jobs were cancelled: slots and ranges already given
    back in the book), rows to admit in one prefill pass (in pass order), and the decode steps
    to run before asking again. Which slots an interactive-only step covers is the runner's to
    say (ocrq/models/hunyuan/runner.py `_extra_steps`): it follows the rows live on the device,
    which a plan does not know (a pass's rows join when it lands, rows end between steps)."""

    drop: tuple[str, ...] = ()
    admit: tuple[Admit, ...] = ()
    decode_steps: int = 1
    blocked: str | None = None  # why admission stopped, if it did (`Admission.blocked`)
    # The interactive lane was busy when the pass was planned (a row of it live or waiting):
    # the runner books the pass's GPU time to the lane (`LoopStats.lane_prefill_s`).
    busy: bool = False
    # The lane's limits held a bulk row back from a pass that admitted others (or would have,
    # but for the prefill gap): `LoopStats.bulk_held_passes`.
    bulk_held: bool = False


@dataclass(frozen=True)
class StepOutput:
    """What the runner did since the last plan: the full decode steps it ran, and the rows it
    saw finish (an eos, their cap, the repetition guard). A row may be named again by a later
    output (a late copy of the slots' state): the scheduler hands each back once."""

    steps: int = 0
    finished: tuple[str, ...] = ()
