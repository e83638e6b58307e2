#!/usr/bin/env bash
# The tests that need TensorFlow, and the other long tests of the Keras, TensorFlow and Spark
# estimator bindings: installs the tensorflow extra (tensorflow-cpu, about 250 MB; it shares
# ringserve's protobuf<8 and grpcio) into .venv on top of scripts/setup.sh, then runs them.
# Extra arguments go to pytest, e.g. scripts/test_tf.sh -k estimator
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv/bin/python -c "import tensorflow" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[torch,dev,spark,keras,tensorflow]"
fi
exec .venv/bin/python -m pytest -p no:cacheprovider -m "tensorflow or slow" \
  tests/keras tests/tensorflow tests/spark_estimators "$@"
