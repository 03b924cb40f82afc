#!/usr/bin/env bash
# CI's packaging check (issue 27): build the wheel, install it into a fresh venv in a temporary
# folder (no checkout on its path), and run the service from it: `ocrq migrate` + `ocrq worker`
# + `ocrq submit --wait` of one image, against the local Redis and PostgreSQL with a database
# and a queue of its own (both removed at the end). Proves the wheel ships the migrations and
# that the default engine works from the base install. About a minute with wheels cached.
#
#   OCRQ_TEST_PG_URL      admin URL of the PostgreSQL to use (default: postgres@127.0.0.1:5432)
#   OCRQ_TEST_BROKER_URL  Redis (default: redis://127.0.0.1:6379/15); only the check's own
#                         queue is used and deleted
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
PG=${OCRQ_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/postgres}
BROKER=${OCRQ_TEST_BROKER_URL:-redis://127.0.0.1:6379/15}
TMP=$(mktemp -d -t ocrq-wheel-check-XXXXXX)
ID=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
DB=ocrq_wheel_$ID
QUEUE=ocr-wheel-$ID
WORKER_PID=
cleanup() {
  if [ -n "$WORKER_PID" ]; then kill -TERM -- "-$WORKER_PID" 2>/dev/null || true; wait "$WORKER_PID" 2>/dev/null || true; fi
  if [ -x "$TMP/venv/bin/python" ]; then
    "$TMP/venv/bin/python" - "$PG" "$DB" "$BROKER" "$QUEUE" <<'PY' || true
import sys
import redis
from sqlalchemy import create_engine, text
pg, db, broker, queue = sys.argv[1:]
engine = create_engine(pg, isolation_level="AUTOCOMMIT")
with engine.connect() as conn:
    conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
redis.Redis.from_url(broker).delete(queue)
PY
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

echo "wheel-check: building the wheel (from a copy: no build/ left in the checkout)"
mkdir -p "$TMP/src" "$TMP/dist"
cp -r pyproject.toml setup.py README.md LICENSE ocrq migrations "$TMP/src/"
find "$TMP/src" -name __pycache__ -prune -exec rm -rf {} +
# pip's log only when it fails (this machine's extra indexes warn about every missing name)
"$PY" -m pip wheel --no-deps -q -w "$TMP/dist" "$TMP/src" >"$TMP/pip.log" 2>&1 || { cat "$TMP/pip.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/ocrq-*.whl)
echo "wheel-check: $(basename "$WHEEL"); a fresh venv"
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q "$WHEEL" >"$TMP/pip.log" 2>&1 || { cat "$TMP/pip.log"; exit 1; }

cd "$TMP"  # nothing of the checkout importable from here
unset PYTHONPATH
export OCRQ_DATABASE_URL=${PG%/*}/$DB OCRQ_BROKER_URL=$BROKER OCRQ_QUEUE=$QUEUE
export OCRQ_CONSUME_DEFAULT_QUEUE=false OCRQ_ALLOWED_ROOTS=$TMP/images OCRQ_ENGINE=rapid
"$TMP/venv/bin/python" -c "import ocrq, sys; assert '$REPO' not in ocrq.__file__, ocrq.__file__; print('wheel-check: ocrq', ocrq.__version__, 'from', ocrq.__file__)"
# The viewer's static files and the typing marker ship as package data (setup.py).
"$TMP/venv/bin/python" -c "import ocrq, pathlib; root = pathlib.Path(ocrq.__file__).parent; missing = [n for n in ('api/viewer_static/viewer.html', 'api/viewer_static/viewer.css', 'api/viewer_static/viewer.js', 'py.typed') if not (root / n).is_file()]; assert not missing, f'not in the wheel: {missing}'"
"$TMP/venv/bin/ocrq" migrate
mkdir -p images
"$TMP/venv/bin/ocrq" samples images >/dev/null
setsid "$TMP/venv/bin/ocrq" worker --concurrency 2 >"$TMP/worker.log" 2>&1 &
WORKER_PID=$!
for _ in $(seq 600); do  # up to 120 s for the engine to load
  grep -q " ready\." "$TMP/worker.log" && break
  kill -0 "$WORKER_PID" 2>/dev/null || { cat "$TMP/worker.log"; echo "wheel-check: worker exited"; exit 1; }
  sleep 0.2
done
grep -q " ready\." "$TMP/worker.log" || { tail -50 "$TMP/worker.log"; echo "wheel-check: worker not ready"; exit 1; }
IMAGE=$(ls images/*.png | head -1)
"$TMP/venv/bin/ocrq" submit --wait --json --timeout 60 "$IMAGE" >"$TMP/result.jsonl"
"$TMP/venv/bin/python" - "$TMP/result.jsonl" <<'PY'
import json, sys
(row,) = [json.loads(line) for line in open(sys.argv[1])]
assert row["status"] == "done" and row["text"], row
print("wheel-check: ok:", row["job_id"], "done:", row["text"][:60].replace("\n", " | "))
PY
