"""Decode hooks: the one door through which a bench changes what the fast loops choose.

Why a door and not a branch: random weights never emit an end of sequence, so a service bench
scripts each row's length (ocrq/testing/scripted.py) to keep its workload real (a word crop ends
after a few tokens, a page after a thousand). That is the bench's business; the engine the
service builds has no hooks (`HunyuanEngine.hooks` is None), and then neither loop holds any
state for them nor runs any op for them: the running loop's decode step, and the CUDA graph
captured from it, is the model's choice and nothing else. With hooks, the running loop keeps a
`ForcedEos` and its step runs one `torch.where` more, captured in the graph like the rest.

How hooks reach an engine: handed to `HunyuanEngine` (tests, a bench's engine in its own
process), or installed for the process before the engine is built (`install`), which is how a
bench reaches the engine inside a worker it started (ocrq/testing/scripted.py, `worker_env`).
Nothing in ocrq installs any: no setting, job field or checkpoint file can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class DecodeHooks(Protocol):
    def eos_at(self, key: str) -> int | None:
        """The index of the new token (0: the first) that the row `key` takes as eos, as if the
        model chose it, or None for the model's own choice. The row's KV range and the memory
        plan still hold its full cap: the plan stays a real model's."""
        ...


_installed: DecodeHooks | None = None


def install(hooks: DecodeHooks | None) -> None:
    """Hooks every engine built from now on in this process takes (None: none again)."""
    global _installed
    _installed = hooks


def installed() -> DecodeHooks | None:
    return _installed


class ForcedEos:
    """The running loop's per-slot state for hooks: the token index at which each slot's row
    takes eos (`never`, past any token, for rows the hooks leave alone and for empty slots).
    A fixed address, like every per-slot tensor of the loop, so a graphed step reads it."""

    def __init__(self, slots: int, never: int, eos: torch.Tensor) -> None:
        import torch

        self.never = never
        self.eos = eos  # (E,) long: the loop's eos ids; the first is the one forced
        self.at = torch.full((slots,), never, dtype=torch.long, device=eos.device)

    def admit(self, slots: torch.Tensor, at: list[int | None]) -> None:
        """Rows newly in `slots`: their hooks' indexes (a host list: no sync)."""
        import torch

        from ocrq.models.hunyuan.readback import to_device

        values = [self.never if a is None else a for a in at]
        self.at.index_copy_(0, slots, to_device(values, torch.long, self.at.device))

    def first(self, nxt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The first tokens of freshly prefilled rows at `slots` (token index 0)."""
        import torch

        return torch.where(self.at[slots] == 0, self.eos[0].expand_as(nxt), nxt)

    def step(self, nxt: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The tokens of a step over the first `len(nxt)` slots, each at index `count`."""
        import torch

        k = nxt.shape[0]
        return torch.where(self.at[:k] == count, self.eos[0].expand_as(nxt), nxt)
