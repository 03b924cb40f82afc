"""ocrq: OCR jobs through Celery into PostgreSQL, batched to a measured memory budget.

This package holds what producers, workers and engines share: the wire contract and the
settings. It imports neither torch nor the engines, so `import api` stays light.
"""
