#!/usr/bin/env bash
# The habits CI holds: ruff (the rules in pyproject.toml) and mypy (strict on ringserve/).
# Sets up .venv first, like scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
