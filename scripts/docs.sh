#!/usr/bin/env bash
# The docs CI holds: the site builds in strict mode (a broken link, a missing page or anchor, a
# reference that does not resolve, a docstring griffe cannot read: each fails), and every Python
# block of the docs runs (or says why not; tests/docs/codeblocks.py). Sets up .venv first.
#   bash scripts/docs.sh            # both
#   bash scripts/docs.sh build      # the site only (site/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NO_MKDOCS_2_WARNING=1
.venv/bin/mkdocs build --strict
echo "docs: site built in strict mode (site/)"
if [ "${1:-}" != build ]; then
  .venv/bin/python tests/docs/codeblocks.py | tail -1
  .venv/bin/python -m pytest -q -p no:cacheprovider -m docs tests/docs
fi
