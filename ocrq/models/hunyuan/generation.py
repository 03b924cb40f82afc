"""Which loop generates a batch, and transformers' own loop (`generate()`), the reference.

Two loops give the same greedy tokens: ocrq/models/hunyuan/decode.py (the default, `Settings.decode`
= "fast", OCRQ_DECODE) and transformers' `generate()` ("generate"). The fast loop implements
greedy search with eos/pad, min_new_tokens, the repetition penalty and the repetition guard
(ocrq/models/hunyuan/repetition.py) only, so a checkpoint whose generation config asks for more (an
n-gram ban, say) runs on `generate()` instead of silently changing its output
(`unsupported_reason`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

from ocrq.core.settings import DecodeAttention, DecodeMode
from ocrq.models.hunyuan.tokens import SpecialTokens
from ocrq.models.hunyuan.versions import RepetitionGuard

if TYPE_CHECKING:
    import torch

# The choices, from the one place they are typed (read once from OCRQ_DECODE[_ATTENTION]).
DECODE_MODES: tuple[str, ...] = get_args(DecodeMode)
ATTENTION_MODES: tuple[str, ...] = get_args(DecodeAttention)


TRUNCATED = ("repetition", "max_tokens")  # why a row ended before its model said so


@dataclass
class Generated:
    """One row of a batched generation."""

    text: str
    token_ids: list[int]  # generated tokens, eos and padding removed
    # None: the row ended at an eos; "max_tokens": at max_new_tokens; "repetition": the
    # repetition guard stopped it (ocrq/models/hunyuan/repetition.py).
    truncated: str | None
    prompt_tokens: int  # row length before padding, image tokens included
    logits: torch.Tensor | None = None  # (steps, vocab) float32, only when asked for
    scores: torch.Tensor | None = None  # (steps, vocab) what each token was chosen from

    @property
    def capped(self) -> bool:
        """Stopped by a limit instead of an eos: its output may end in a loop worth trimming."""
        return self.truncated is not None


@dataclass
class BatchOutput:
    """Per-item results in input order (an Exception for an item that failed alone)."""

    items: list[Generated | Exception]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    padded_length: int = 0  # prompt length every row was padded to


def greedy_config(checkpoint_config: Any) -> Any:
    """The checkpoint's generation config made greedy (OCR wants the most likely reading, and
    the same one every time); eos and pad are set per call from the engine's SpecialTokens."""
    gen = copy.deepcopy(checkpoint_config)
    gen.do_sample = False
    gen.num_beams = 1
    gen.temperature = gen.top_p = gen.top_k = None
    return gen


def unsupported_reason(gen: Any) -> str | None:
    """Why the fast loop cannot reproduce `generate()` under this generation config, or None."""
    if getattr(gen, "do_sample", False):
        return "sampling"
    if (getattr(gen, "num_beams", 1) or 1) != 1:
        return "beam search"
    for name, neutral in (
        ("encoder_repetition_penalty", 1.0),
        ("no_repeat_ngram_size", 0),
        ("min_length", 0),
        ("guidance_scale", 1.0),
    ):
        value = getattr(gen, name, None)
        if value not in (None, neutral):
            return f"{name}={value}"
    for name in (
        "bad_words_ids",
        "suppress_tokens",
        "begin_suppress_tokens",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "sequence_bias",
        "exponential_decay_length_penalty",
        "stop_strings",
        "watermarking_config",
        "force_words_ids",
        "constraints",
    ):
        if getattr(gen, name, None):
            return name
    return None


def generate_plain(
    model: Any,
    gen: Any,
    tokens: SpecialTokens,
    inputs: dict[str, torch.Tensor],
    *,
    max_new_tokens: int,
    min_new_tokens: int | None,
    output_logits: bool,
    guard: RepetitionGuard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """transformers' `generate()` on collated inputs: new tokens (B, steps) on the CPU, every
    step's raw logits and the scores chosen from (B, steps, V) in float32 when asked, and per
    row the tokens it kept when the repetition `guard` stopped it (else 0)."""
    import torch
    from transformers import StoppingCriteriaList

    from ocrq.models.hunyuan.repetition import guard_criteria

    padded = int(inputs["input_ids"].shape[1])
    inputs = dict(inputs)
    inputs.pop("position_ids", None)  # generate() derives them from the inputs itself
    gen = copy.copy(gen)
    gen.eos_token_id = tokens.eos_list
    gen.pad_token_id = tokens.pad
    gen.max_new_tokens = max_new_tokens
    gen.min_new_tokens = min_new_tokens
    gen.return_dict_in_generate = True
    gen.output_logits = output_logits
    gen.output_scores = output_logits
    criteria = StoppingCriteriaList()
    if guard is not None:
        stopper = guard_criteria(
            guard, padded, tokens.eos_list, min_new=min_new_tokens or 0, max_new=max_new_tokens
        )
        criteria.append(stopper)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=gen, stopping_criteria=criteria)
    new = out.sequences[:, padded:].cpu()
    logits = torch.stack(out.logits, dim=1).float().cpu() if output_logits else None
    scores = torch.stack(out.scores, dim=1).float().cpu() if output_logits else None
    del out
    stopped = torch.zeros(new.shape[0], dtype=torch.long)
    if guard is not None:
        for row, kept in stopper.stopped.items():
            stopped[row] = kept
    return new, logits, scores, stopped


def generated_rows(
    new: torch.Tensor,
    logits: torch.Tensor | None,
    tokens: SpecialTokens,
    processor: Any,
    prompt_lengths: list[int],
    *,
    scores: torch.Tensor | None = None,
    stopped: torch.Tensor | None = None,
    caps: list[int] | None = None,
) -> list[Generated]:
    """Each row of a generation (new tokens (B, steps), either loop's) cut at its eos, or where
    the repetition guard stopped it (`stopped`), decoded to text, with its logits and scores up
    to and including the eos step.

    `caps`: each row's own max_new_tokens, when a batch ran to the largest of them. A row is
    cut as a run to its own cap would have ended it: greedy tokens do not depend on how long the
    others run, and the guard never stops a row at its cap (it is `max_tokens` there)."""
    token_rows, no_eos = tokens.cut(new.tolist())
    kept = stopped.tolist() if stopped is not None else [0] * len(token_rows)
    truncated: list[str | None] = []
    for j, ids in enumerate(token_rows):
        cap = caps[j] if caps is not None else len(ids) + 1
        if kept[j] and len(ids) >= kept[j] and kept[j] < cap:  # the guard stopped it first
            token_rows[j] = ids[: kept[j]]
            truncated.append("repetition")
        elif len(ids) >= cap:  # its cap came before its eos (if any)
            token_rows[j] = ids[:cap]
            truncated.append("max_tokens")
        else:
            truncated.append("max_tokens" if no_eos[j] else None)
    texts = processor.batch_decode(
        token_rows, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    out = []
    for j, ids in enumerate(token_rows):
        steps = len(ids) + (0 if truncated[j] else 1)  # the eos step has logits too
        out.append(
            Generated(
                text=texts[j],
                token_ids=ids,
                truncated=truncated[j],
                prompt_tokens=prompt_lengths[j],
                logits=logits[j, :steps] if logits is not None else None,
                scores=scores[j, :steps] if scores is not None else None,
            )
        )
    return out
