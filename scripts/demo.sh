#!/usr/bin/env bash
# One command on a fresh machine: set everything up, then train the demo on 4 local workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ringserve run -np "${NP:-4}" .venv/bin/python examples/train_digits.py "$@"
