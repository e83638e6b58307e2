#!/usr/bin/env bash
# The status page's browser tests (tests/observe/test_status_browser.py, marker `browser`,
# deselected by default): sets up .venv as scripts/setup.sh does, installs Debian's chromium and
# chromium-driver with apt-get when they are missing (as root; never a downloaded browser) and the
# browser extra (Selenium), then runs them headless. Extra arguments go to pytest.
# RINGSERVE_UPDATE_SCREENSHOT=1 makes the test replace docs/img/status-page.png with its screenshot.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }
  else
    echo "test_browser.sh: install Debian's chromium and chromium-driver (apt-get, as root) first" >&2
    exit 1
  fi
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[browser]"
exec .venv/bin/python -m pytest -p no:cacheprovider -m browser tests/observe/test_status_browser.py "$@"
