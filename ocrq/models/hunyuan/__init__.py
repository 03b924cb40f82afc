"""HunyuanOCR (Tencent's 1B OCR vision-language model, 1.0 and 1.5) through transformers, on one
device.

The package, one job a module: `engine` (the static engine: load, plan, run batches),
`loop_engine` (the engine whose rows run in the running loop; `runs_loop` says which a worker
gets), `checkpoint` (finding and loading the weights, never downloading them), `versions` (what
differs between 1.0 and 1.5, and which one a checkpoint is), `patches` (two changes to
transformers' model, with why),
`prompts` (each version's official task prompts), `resolution` (per-task pixel presets),
`geometry` (tokens and patches per image, without torch), `inputs` (preprocessing in prefetch
threads, collation), `tokens` (eos/pad ids), `generation` (which loop runs, transformers' own),
`decode` + `prefill` + `text` (the fast loop), `running` (the running loop; its words in
`loop_types`, its state in `loop_state` and `slot_tensors`), `repetition` (the repetition
penalty and the loop guard, for both loops), `attention` + `kernels` (its Triton kernels),
`output` (parsing answers), `memory` (cost-model defaults and the device's counters), `tiny`
(random checkpoints for tests and benches). Importing it needs no torch.
"""

from ocrq.models.hunyuan.checkpoint import ModelNotFound
from ocrq.models.hunyuan.engine import HunyuanEngine
from ocrq.models.hunyuan.loop_engine import HunyuanLoopEngine, runs_loop

__all__ = ["HunyuanEngine", "HunyuanLoopEngine", "ModelNotFound", "runs_loop"]
