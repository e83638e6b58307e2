#!/usr/bin/env bash
# PyTorch's own distributed suite (from the installed torch wheel) on ringserve and on gloo, at
# worlds 2 and 3, and the table of what differs. Exits 1 when a test that passes on gloo does not
# pass on ringserve and is not in scripts/torch_dist_suite_known.txt. About 15-20 minutes per
# backend and world on two cores; see scripts/torch_dist_suite.py for the options.
#
#   scripts/torch_dist_suite.sh                       # everything, outcomes under ./torch-dist-suite
#   scripts/torch_dist_suite.sh --worlds 2 --only 'test_all_gather_coalesced'
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# torch's test helpers import expecttest, which torch's wheel does not depend on.
"$PYTHON" -c "import expecttest" 2>/dev/null || "$PYTHON" -m pip install --quiet --disable-pip-version-check expecttest
exec "$PYTHON" scripts/torch_dist_suite.py "$@"
