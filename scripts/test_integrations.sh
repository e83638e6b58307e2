#!/usr/bin/env bash
# The training frameworks on the "ringserve" backend against gloo (tests/integrations, marker
# `integrations`, deselected by default): sets up .venv as scripts/setup.sh does, then installs the
# lightning, hugging-face and deepspeed extras (pinned in pyproject.toml) with every package already
# there frozen at its version: torch stays the CPU torch==2.13.0 (a bare "torch" requirement would
# pull a multi-GB CUDA build), and numpy, protobuf and grpcio stay as the core pins them. DeepSpeed
# is a source package: it is built without its compiled ops (DS_BUILD_OPS=0); its CPU accelerator
# compiles its shared-memory op at the first run (needs a C++ compiler; cached in ~/.cache).
# Extra arguments go to pytest, e.g. scripts/test_integrations.sh -k lightning
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
.venv/bin/pip freeze --exclude-editable --disable-pip-version-check > "$constraints"
DS_BUILD_OPS=0 .venv/bin/pip install --quiet --disable-pip-version-check -c "$constraints" \
  -e ".[lightning,hugging-face,deepspeed]"
exec .venv/bin/python -m pytest -p no:cacheprovider -m integrations tests/integrations "$@"
