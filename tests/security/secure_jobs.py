"""A job under each launcher, for tests/security/test_secure_default.py: run inside a network
namespace the test makes, where this host's address is off loopback.

    python secure_jobs.py worker          # as a worker of `ringserve run` (its environment)
    python secure_jobs.py torch           # as a rank of torchrun, on the "ringserve" backend
    python secure_jobs.py spark HOST N    # the driver of ringserve.spark.run, N tasks
    python secure_jobs.py ray HOST N      # the driver of a RayExecutor on a node at HOST, N actors

Each worker first calls the job's coordinator as an outsider would, with no token, and reports
the answer (``refused: UNAUTHENTICATED`` where the job is secure), then joins as the launcher
made it, allreduces its rank + 1 and reports the sum: the job's own workers must still finish.
"""

from __future__ import annotations

import json
import os
import sys

import grpc
import numpy as np

from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc


def outsider(coordinator: str) -> str:
    """What the coordinator answers a call that carries no token."""
    with grpc.insecure_channel(coordinator) as channel:
        try:
            pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=10)
        except grpc.RpcError as e:
            return f"refused: {e.code().name}"
    return "answered"


def report(**fields: object) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def as_worker() -> dict[str, object]:
    """A worker started with RINGSERVE_COORDINATOR (and the token, if the launcher made one)."""
    import ringserve

    answer = outsider(os.environ["RINGSERVE_COORDINATOR"])
    ringserve.init()
    try:
        total = ringserve.allreduce(np.array([ringserve.rank() + 1.0]), op="sum")
        return {"rank": ringserve.rank(), "outsider": answer, "sum": float(total[0]),
                "token_in_env": bool(os.environ.get("RINGSERVE_TOKEN"))}
    finally:
        ringserve.shutdown()


def as_torch_rank() -> None:
    import torch
    import torch.distributed as dist

    import ringserve.torch.distributed  # noqa: F401  (registers the backend)
    from ringserve import api

    dist.init_process_group("ringserve")
    try:
        answer = outsider(api.context().config.coordinator)
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        report(rank=dist.get_rank(), outsider=answer, sum=float(t[0]))
    finally:
        dist.destroy_process_group()


def as_spark_driver(host: str, n: int) -> None:
    from pyspark import SparkConf, SparkContext

    import ringserve.spark

    conf = SparkConf().setMaster(f"local[{n}]").setAppName("secure-default").set("spark.driver.host", host)
    conf = conf.set("spark.driver.bindAddress", host).set("spark.ui.enabled", "false")
    sc = SparkContext(conf=conf)
    try:
        for result in ringserve.spark.run(as_worker, num_proc=n, start_timeout=60):
            report(**result)
    finally:
        sc.stop()


def as_ray_driver(host: str, n: int) -> None:
    import ray

    from ringserve.ray import RayExecutor

    ray.init(num_cpus=n, include_dashboard=False, _node_ip_address=host)  # a node off loopback
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=n, cpus_per_worker=1)
    try:
        executor.start()
        for result in executor.run(as_worker):
            report(**result)
    finally:
        executor.shutdown()
        ray.shutdown()


def main() -> None:
    mode = sys.argv[1]
    if mode == "worker":
        report(**as_worker())
    elif mode == "torch":
        as_torch_rank()
    elif mode == "spark":
        as_spark_driver(sys.argv[2], int(sys.argv[3]))
    elif mode == "ray":
        as_ray_driver(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
