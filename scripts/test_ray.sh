#!/usr/bin/env bash
# The Ray tests (tests/raycluster, marker `ray`, deselected by default): sets up .venv as
# scripts/setup.sh does, installs the ray extra (Ray 2.60.0 with Ray Train; it pulls no torch: the
# pinned CPU torch==2.13.0 is already there), then runs them on a local Ray cluster on 127.0.0.1.
# Extra arguments go to pytest, e.g. scripts/test_ray.sh -k elastic
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[ray]"
# Ray on loopback only ("local cluster" mode), and no usage statistics sent anywhere.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m pytest -p no:cacheprovider -m ray tests/raycluster "$@"
