"""local[4] SparkSessions on loopback for the estimator tests (one per module)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")


def _session(**conf: str) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    os.environ.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    builder = (SparkSession.builder.master("local[4]").config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    try:
        yield session
    finally:
        session.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def no_tests_tensorflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tensorflow installed, the tests/tensorflow folder on sys.path (pytest puts tests/ there)
    is found as a namespace package named tensorflow, and Keras, taking it for tensorflow, fails to
    save a model (``module 'tensorflow' has no attribute 'TensorShape'``). Take tests/ off sys.path,
    and forget that package, in sys.modules and in Keras' lazy handle on tensorflow, for the test."""
    tests = str(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p) != tests])
    found = sys.modules.get("tensorflow")
    if found is not None and getattr(found, "__file__", None) is None:
        monkeypatch.delitem(sys.modules, "tensorflow")
    from keras.src.utils import module_utils

    lazy = module_utils.tensorflow
    if lazy.module is not None and getattr(lazy.module, "__file__", None) is None:
        monkeypatch.setattr(lazy, "module", None)
        monkeypatch.setattr(lazy, "_available", None)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    yield from _session()


@pytest.fixture(scope="module")
def spark_ml() -> Iterator[Any]:
    """A session whose driver may receive at most 1 MiB of results per action (less than the tests'
    big DataFrame), with ml_models.py shipped to the executors (torch checkpoints name the class)."""
    import ml_models

    for session in _session(**{"spark.driver.maxResultSize": "1m"}):
        session.sparkContext.addPyFile(ml_models.__file__)
        yield session
