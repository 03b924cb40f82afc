"""ocrq: OCR jobs through Celery into PostgreSQL, batched to a measured memory budget.

This package holds what producers, workers and engines share: the wire contract and the
settings. It imports neither torch nor the engines, so `import api` stays light.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    # From the installed distribution's metadata (pyproject's version): one number to bump.
    __version__ = _version("ocrq")
except PackageNotFoundError:  # a source tree on PYTHONPATH with no installed distribution
    __version__ = "0+unknown"
