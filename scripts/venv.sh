#!/usr/bin/env bash
# Create .venv with Python >= 3.11 and install ocrq with the given extras (idempotent).
# Usage: scripts/venv.sh EXTRAS [extra pip args...]
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-cpu}; shift || true
py=${PYTHON:-python3}
if ! "$py" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "ocrq needs Python >= 3.11 (found: $("$py" --version 2>&1))" >&2; exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$py" -m venv .venv 2>/dev/null; then
    # Debian splits venv out of the interpreter package.
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    rm -rf .venv; "$py" -m venv .venv
  fi
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.ocrq-installed-$(echo "$extras $* $(sha1sum pyproject.toml | cut -c1-12)" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]" "$@"
  touch "$stamp"
fi
