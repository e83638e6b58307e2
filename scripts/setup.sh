#!/usr/bin/env bash
# Sets up .venv with everything ringserve needs: torch first (pinned, CPU build), then the package
# with its torch, spark and dev extras. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch==2.13.0 comes first: a bare "torch" requirement would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# The spark extra (pyspark) runs the Spark tests; it needs Java 17 or newer on the machine.
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[torch,dev,spark]"
