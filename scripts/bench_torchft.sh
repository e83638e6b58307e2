#!/usr/bin/env bash
# ringserve against torchft (benchmarks/vs_torchft.py, docs/benchmarks/vs-torchft.md): installs the
# benchmark-only torchft extra, then runs the benchmark; with --test first, runs its short round as
# a test instead (tests/torchft, marker `torchft`, deselected by default). Neither scripts/setup.sh
# nor CI installs the extra.
# Every package of the extra is installed at its pin with --no-deps: torchft asks for torch>=2.7,
# and a resolver that took that up could pull a multi-GB CUDA build over the pinned CPU
# torch==2.13.0. The pins are read from pyproject.toml, their one home.
# Extra arguments go to the benchmark (or to pytest after --test), e.g.
#   scripts/bench_torchft.sh --rounds 3 --json benchmarks/results/vs_torchft.json
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import torch, ringserve" 2>/dev/null; then
  bash scripts/setup.sh
fi
mapfile -t pins < <(.venv/bin/python -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["torchft"]))')
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps "${pins[@]}"
# A runtime import that the list misses fails here, by name, before any benchmark starts.
.venv/bin/python -c "import torchft, torchft.local_sgd"
if [ "${1:-}" = "--test" ]; then
  shift
  exec .venv/bin/python -m pytest -p no:cacheprovider -m torchft tests/torchft "$@"
fi
exec .venv/bin/python benchmarks/vs_torchft.py "$@"
