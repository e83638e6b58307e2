"""Runs ``transform`` on a DataFrame larger than the driver's memory, in a process of its own (the JVM's
heap is fixed when it starts): ``python transform_beyond_memory.py ROWS``.

local[2] with ``spark.driver.memory=512m``: in local mode the driver's JVM is also the executor, so
the whole job lives in that heap, and a transform that held the data anywhere in it would fail.
``spark.driver.maxResultSize=1m`` caps what any action brings to the driver. The rows are made on
the executors (``spark.range``), go through the assemblers and the model in Arrow batches, and
only a count, a sum and a max come back, compared with the model run here on the same ids in
chunks. Prints one JSON line: the rows, the heap, the data's lower bound in bytes, the aggregates,
the local ones, the seconds, and this process's peak RSS by the end of the Spark job.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import ml_models
import numpy as np


def main(rows: int) -> None:
    from pyspark.ml import PipelineModel
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    os.environ.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.driver.memory", "512m")
             .config("spark.driver.maxResultSize", "1m").getOrCreate())
    try:
        spark.sparkContext.addPyFile(ml_models.__file__)
        heap = int(spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory())
        pipeline = PipelineModel(stages=[*ml_models.assemblers(), ml_models.untrained_model()])
        start = time.monotonic()
        out = pipeline.transform(ml_models.frame(spark, rows, partitions=8)).agg(
            F.count("*").alias("n"), F.sum("label__output").alias("total"), F.max("label__output").alias("top")).first()
        seconds = time.monotonic() - start
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the local check below
    finally:
        spark.stop()
    model = pipeline.stages[-1].getModel()
    total, top = 0.0, -np.inf
    for ids in np.array_split(np.arange(rows), max(1, rows // 100_000)):
        p = ml_models.local_predictions(model, ids)
        total, top = total + float(p.sum()), max(top, float(p.max()))
    # 13 doubles a row (x1..x3, s0..s3, dense's 3, arr's 2, num, label) is a lower bound of the data.
    print(json.dumps({"rows": out["n"], "heap": heap, "data_bytes_at_least": rows * 13 * 8, "total": out["total"],
                      "top": out["top"], "local_total": total, "local_top": top, "seconds": round(seconds, 1),
                      "driver_python_peak_rss": peak_rss}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
