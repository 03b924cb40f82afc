#!/usr/bin/env bash
# The headless browser the viewer's test drives (tests/test_viewer.py): Debian's chromium and
# its chromedriver, installed when missing (idempotent; sudo when not root).
set -euo pipefail
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium chromium-driver >/dev/null
fi
