#!/usr/bin/env bash
# Quick start, part 1: install ocrq with the CPU engine and OCR the sample images, embedded
# (no Redis, no PostgreSQL). Results: out/results.jsonl (rows in a temporary SQLite file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh cpu
.venv/bin/ocrq samples samples >/dev/null
mkdir -p out
.venv/bin/ocrq run samples --output out/results.jsonl
.venv/bin/python - <<'PY'
import json
for line in open("out/results.jsonl", encoding="utf-8"):
    row = json.loads(line)
    print(f"{row['path']}: {row['status']}: {(row['text'] or row['error'] or '').replace(chr(10), ' | ')}")
PY
