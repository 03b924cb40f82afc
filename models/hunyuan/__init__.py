"""HunyuanOCR (Tencent's 1B OCR vision-language model) through transformers, on one device.

The package, one job a module: `engine` (the Engine the worker drives), `checkpoint` (finding
and loading the weights, never downloading them), `patches` (two changes to transformers' model,
with why), `prompts` (the official task prompts), `geometry` (tokens and patches per image,
without torch), `inputs` (preprocessing in prefetch threads, collation), `tokens` (eos/pad ids),
`generation` (which loop runs, transformers' own), `decode` + `prefill` + `text` (the fast loop),
`attention` + `kernels` (its Triton kernels), `output` (parsing answers), `memory` (cost-model
defaults and the device's counters), `tiny` (a random checkpoint for tests and benches).
Importing it needs no torch.
"""

from models.hunyuan.checkpoint import ModelNotFound
from models.hunyuan.engine import HunyuanEngine

__all__ = ["HunyuanEngine", "ModelNotFound"]
