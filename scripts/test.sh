#!/usr/bin/env bash
# One command on a fresh machine: set everything up, then run the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
