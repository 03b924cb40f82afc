#!/usr/bin/env bash
# Issue 31, item 9: the suite's fault modules, N runs in a row (default 10), each run's summary
# line appended to $OUT/summary (default /tmp/fault-loop). Run it on a quiet machine, in a clean
# clone with a .venv (scripts/test.sh makes one): `bash scripts/fault-loop.sh 10`.
set -u
cd "$(dirname "$0")/.."
runs=${1:-10}
out=${OUT:-/tmp/fault-loop}
mkdir -p "$out"
export PYTHONPATH=$PWD OCRQ_EVAL_DATA=${OCRQ_EVAL_DATA:-$PWD/../shared/data/ocr-eval}
mods="tests/test_faults.py tests/test_liveness.py tests/test_recovery.py tests/test_sentinel.py
tests/test_final_rows.py tests/test_documents.py tests/test_engine_process.py
tests/test_retry_gate.py tests/test_pdf_bombs.py"
for i in $(seq 1 "$runs"); do
  s=$(date +%s)
  # shellcheck disable=SC2086
  .venv/bin/python -m pytest -q -p no:cacheprovider $mods > "$out/run$i.log" 2>&1
  rc=$?
  echo "run $i rc=$rc $(( $(date +%s) - s )) s $(tail -1 "$out/run$i.log") load=$(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/summary"
  [ "$rc" = 0 ] || { echo "run $i failed: $out/run$i.log"; exit 1; }
done
echo "$runs runs in a row passed" | tee -a "$out/summary"
