#!/usr/bin/env bash
# Sets up .venv with everything ringserve needs: torch first (pinned, CPU build), then the package
# with its torch, spark, status and dev extras. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# The multi-host launcher tests run real sshd servers in network namespaces (tests/cli/sshnet.py):
# as root (where those tests run), install OpenSSH if it is missing.
if [ "$(id -u)" = 0 ] && { ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1; then
    # policy-rc.d keeps the package from starting a system sshd; the tests start their own.
    if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; rc_made=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client >/dev/null; } \
      || echo "setup.sh: could not install openssh-server; the multi-host launcher tests will fail" >&2
    if [ "${rc_made:-0}" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    echo "setup.sh: sshd is missing and apt-get is not here; the multi-host launcher tests will fail" >&2
  fi
fi
# The payload lane's fallback test puts an nginx gRPC proxy in front of a worker
# (tests/integration/test_lane_proxy.py): as root, install Debian's nginx if it is missing.
if [ "$(id -u)" = 0 ] && ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  if command -v apt-get >/dev/null 2>&1; then
    # policy-rc.d keeps the package from starting a system nginx; the test starts its own.
    if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; rc_made=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; } \
      || echo "setup.sh: could not install nginx; the payload lane's proxy test will be skipped" >&2
    if [ "${rc_made:-0}" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    echo "setup.sh: nginx is missing and apt-get is not here; the payload lane's proxy test will be skipped" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch==2.13.0 comes first: a bare "torch" requirement would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# The spark extra (pyspark) runs the Spark tests; it needs Java 17 or newer on the machine. The keras
# extra is Keras 3 alone (small); the tensorflow extra is large and installed by scripts/test_tf.sh.
# The status extra (aiohttp) serves the coordinator's status page. The docs extra builds the site
# (scripts/docs.sh) and draws the benchmark charts.
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[torch,dev,spark,keras,status,docs]"
