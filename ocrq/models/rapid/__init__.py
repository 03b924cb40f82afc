"""CPU engine: PaddleOCR's PP-OCR ONNX models (PP-OCRv6 small by default, PP-OCRv4 on request:
`models.MODEL_SETS`, OCRQ_RAPID_MODELS), as shipped inside pinned wheels.

Why not call `RapidOCR()` per image: it reads one image at a time, so the classifier and the
recogniser would see a handful of crops per call. Here detection runs per image (sizes differ),
then the crops of ALL images of the batch go through the classifier and the recogniser together,
grouped by padded input width so that no crop's reading depends on its batch-mates.

Departures from the library's own pipeline, each measured on the shared eval set
(bench/results/eval_accuracy/accuracy_rapid.md has the figures):

* Small images (shorter side <= LINE_MAX_SIDE) may be tight word or line crops, on which the
  library's detector, run on an upscaled copy, finds no box or a wrong one (it reads 8% of the SVT
  word crops). They are detected at their own scale on a padded canvas instead, and unless that
  finds two or more rows of text the whole image is read as one line. Any image the detector
  finds nothing on is read whole too. A strip too long to read whole in one recogniser tile (a
  13340x124 text line) is read from its detected boxes, and is not squeezed for the detector.
  A narrow image read whole is stretched towards 3:1 first (by at most the set's `widen_max`).
* PP-OCRv4's recogniser (a Chinese+English model) seldom emits the space between English words
  on receipts, which ruins token-level results (SROIE token F1 0.57). With that set a space is
  inserted where a blank gap in the crop, wide for the text's size and for its letter spacing,
  lies between two characters (`word_gaps`); between two digits, net of the blank a narrow
  tabular "1" leaves. PP-OCRv6 emits its own spaces, and the gaps are off for it.
* Nothing inside grows without bound with the image (`geometry`, `tiles`): the detector's input
  stays within 4 MP and 16384 px a side; a line wider than 1920 recogniser columns is read in
  overlapping tiles, and one needing more than 65536 columns (a 1x3000 image read as a line) is
  refused with a per-image `LineTooLong`. A 1x100000 PNG once asked for 22 GB.
* The direction classifier's votes decide per image, not per line: an image's detected lines
  are turned over together when most of them read upside down, else none is (`RapidEngine._read`).
* Crops are cut from the image as handed in, not from the detector's downscaled copy: a 4961x7016
  receipt is detected at 1414x2000 but its lines are read at full resolution.
* Lines come back in reading order: the page is cut into columns and blocks (an XY-cut over the
  detected boxes, `ordering`), read block by block, each top-to-bottom and left-to-right, with a
  blank line between blocks in the text; a receipt, one column, is read row by row as before.
  Boxes on one row a word space apart are merged into one Line, boxes further apart (the two
  sides of a receipt line) are not. A detected box that runs across a column gutter (v6 joins
  the level first lines of two columns) is cut there before it is read (`ordering.gutter_cuts`);
  a heading's deck set under one column is read with the heading, after the columns.

Nothing is downloaded: the model files ship with pinned wheels (`models` says which and why),
and `load()` fails at start-up with a clear error when they are missing or not the files
expected (SHA-256).
"""

from ocrq.models.rapid.engine import RapidEngine, unsupported_task
from ocrq.models.rapid.geometry import DetPlan, det_plan
from ocrq.models.rapid.models import DEFAULT_MODEL_SET, MODEL_SETS, ModelSet, model_set
from ocrq.models.rapid.tiles import LineTooLong

__all__ = [
    "DEFAULT_MODEL_SET",
    "MODEL_SETS",
    "DetPlan",
    "LineTooLong",
    "ModelSet",
    "RapidEngine",
    "det_plan",
    "model_set",
    "unsupported_task",
]
