"""A bench's scripted lengths: each row of a random-weight checkpoint ends at a length the bench
drew, as the decode hooks of ocrq/models/hunyuan/hooks.py.

Why: random weights never emit an end-of-sequence token, so without this every row of a
service benchmark runs to `OCRQ_MAX_NEW_TOKENS` and the workload loses what makes it real
(a word crop ends after a few tokens, a dense page after a thousand). The bench writes a table
(job id -> new tokens, eos included) beside the checkpoint; `ScriptedLengths` makes the loops
take the checkpoint's eos as the row's token at that step, exactly where a trained model would
stop, so the row ends as finished (no `truncated`) and the memory plan still budgets the full
`max_new_tokens`.

How the hooks reach the engine: a bench holding the engine passes them in
(`HunyuanEngine(settings, hooks=ScriptedLengths.for_checkpoint(path))`); a bench that starts a
worker (whose engine may live in an engine process of its own) runs it with `worker_env`, whose
`sitecustomize` installs them in every Python process of that worker before any engine is built.
Production cannot reach them: nothing under ocrq but this package names them (an import
contract checks it), and they refuse any checkpoint that is not a random-weight one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from ocrq.models.hunyuan.checkpoint import is_random_checkpoint
from ocrq.models.hunyuan.hooks import install

log = logging.getLogger(__name__)

TABLE_NAME = "ocrq_scripted_lengths.json"  # {job id: new tokens including the eos}


class ScriptedLengths:
    """`DecodeHooks` that end the rows the table names at their lengths (eos included); the
    others keep the model's own choice."""

    def __init__(self, lengths: Mapping[str, int]) -> None:
        self.lengths = {str(k): int(v) for k, v in lengths.items() if int(v) >= 1}

    def eos_at(self, key: str) -> int | None:
        n = self.lengths.get(key)
        return None if n is None else n - 1

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> ScriptedLengths:
        """The table beside a random-weight checkpoint (empty without one); ValueError for any
        other checkpoint: scripted lengths on real weights would be a wrong result."""
        if not is_random_checkpoint(model_dir):
            raise ValueError(f"{model_dir} is not a random-weight checkpoint: no scripted lengths")
        path = model_dir / TABLE_NAME
        table = json.loads(path.read_text()) if path.is_file() else {}
        hooks = cls(table)
        log.warning(
            "bench mode: %d rows of this random-weight checkpoint end at scripted lengths (%s)",
            len(hooks.lengths),
            path,
        )
        return hooks


def write_table(model_dir: Path, lengths: Mapping[str, int]) -> Path:
    path = model_dir / TABLE_NAME
    path.write_text(json.dumps(dict(lengths)))
    return path


def install_for_checkpoint(model_dir: Path) -> ScriptedLengths:
    """Install the checkpoint's scripted lengths for every engine this process builds."""
    hooks = ScriptedLengths.for_checkpoint(model_dir)
    install(hooks)
    return hooks


SITECUSTOMIZE = """\
# Written by ocrq/testing/scripted.py (worker_env): a bench's scripted lengths, installed in
# every Python process started with this folder first on PYTHONPATH.
from pathlib import Path

from ocrq.testing.scripted import install_for_checkpoint

install_for_checkpoint(Path({model_dir!r}))
"""


def worker_env(model_dir: Path, folder: Path, env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a worker (and its supervisor and engine processes, which inherit it) whose
    engines take the scripted lengths of `model_dir`: a `sitecustomize.py` in `folder`, put
    first on PYTHONPATH, installs them at each interpreter's start."""
    if not is_random_checkpoint(model_dir):
        raise ValueError(f"{model_dir} is not a random-weight checkpoint: no scripted lengths")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(model_dir=str(model_dir.resolve()))
    )
    paths = [str(folder.resolve()), *filter(None, [env.get("PYTHONPATH", "")])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}
