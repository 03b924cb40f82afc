"""Test and bench helpers (tiny random-weight checkpoints), importable by tests and bench,
never by production code."""
