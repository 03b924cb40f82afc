"""`python -m ocrq.cli`: the benches start workers this way, with the interpreter they run in."""

from ocrq.cli import app

app()
