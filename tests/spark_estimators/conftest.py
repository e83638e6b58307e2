"""local[4] SparkSessions on loopback for the estimator tests (one per module)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
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
