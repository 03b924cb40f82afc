"""transformers' generate() on images, run under .venv-vllm's interpreter by the vLLM tests.

Why in that venv: the reference must come from the same torch and transformers builds vLLM
runs on. Across the two venvs (torch 2.13 CPU vs 2.14, transformers 5.19 vs 5.24) float noise
flips near-tied greedy choices of the tiny random model (seen on one image of four), which would
test the venvs' arithmetic, not the engines.

    python tests/vllm_reference.py CHECKPOINT MAX_NEW_TOKENS '{"name": ["path", "task"], ...}'

prints {"name": {"text": ..., "token_ids": [...]}} as JSON on its last line.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    from PIL import Image

    from ocrq.core.settings import Settings
    from ocrq.models.base import PreparedImage
    from ocrq.models.hunyuan import HunyuanEngine

    ckpt, max_new_tokens, spec = argv[0], int(argv[1]), json.loads(argv[2])
    # vLLM 0.32 runs HunYuanVL through its transformers backend, with transformers' image-token
    # numerics (ocrq/models/hunyuan/fidelity.py), so the reference takes them too.
    settings = Settings(
        model=ckpt,
        dtype="float32",
        device="cpu",
        max_new_tokens=max_new_tokens,
        hunyuan_rope="transformers",
        hunyuan_vit_positions="transformers",
    )
    engine = HunyuanEngine(settings, decode="generate")
    engine.load()
    items = []
    for name, (path, task) in spec.items():
        image = Image.open(path).convert("RGB")
        item = PreparedImage(name, image, image.size, task=task)
        engine.prepare(item)
        items.append(item)
    rows = engine.generate(items).items
    results = engine.run(items)
    out = {}
    for item, row, res in zip(items, rows, results, strict=True):
        if isinstance(row, Exception) or isinstance(res, Exception):
            raise SystemExit(f"reference failed on {item.key}: {row!r} {res!r}")
        out[item.key] = {"text": res.text, "token_ids": row.token_ids}
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])
