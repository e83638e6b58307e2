"""The compose demo's worker: the parameter-server demo when shards are there, else the elastic ring demo.

    docker-compose up --scale worker=4                               # train_digits_elastic.py
    docker-compose --profile ps up --scale worker=4 --scale ps=2     # train_digits_ps.py

One ``worker`` service serves both, since a compose profile adds services but cannot change one.
The worker joins the world first, which takes the coordinator's settle window (5 s in compose);
the ``ps`` replicas start beside the workers and have registered by then. It then asks the
coordinator's directory (ListShards) whether parameter-server shards are there, for at most
``--ps-wait`` seconds more, and runs the demo that fits.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

import ringserve as rs
from ringserve._proto import coordinator_pb2 as cpb
from ringserve._proto import coordinator_pb2_grpc as cpb_grpc
from ringserve.config import WorkerConfig
from ringserve.security import Security


def shards_listed(wait_s: float) -> int:
    """The number of shards the directory expects (0: none registered within ``wait_s``)."""
    config = WorkerConfig.from_env()
    deadline = time.monotonic() + wait_s
    with Security.load(config).sync_channel(config.coordinator) as channel:
        stub = cpb_grpc.CoordinatorStub(channel)
        while True:
            try:
                listing = stub.ListShards(cpb.ListShardsRequest(), timeout=config.rpc_timeout_s)
                if listing.shards:
                    return int(listing.shards)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a coordinator without a directory
                    return 0
            if time.monotonic() >= deadline:
                return 0
            time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", default="20")
    parser.add_argument("--commit-every", default="1", help="the elastic demo's steps between commits")
    parser.add_argument("--ps-mode", default="ssp", help="the parameter-server demo's mode")
    parser.add_argument("--ps-wait", type=float, default=1.0,
                        help="seconds to wait for shards to register, once joined")
    args = parser.parse_args()
    rs.init()
    if shards_listed(args.ps_wait):
        import train_digits_ps

        return train_digits_ps.main(["--epochs", args.epochs, "--mode", args.ps_mode])
    import train_digits_elastic

    sys.argv = [sys.argv[0], "--epochs", args.epochs, "--commit-every", args.commit_every]
    return train_digits_elastic.main()


if __name__ == "__main__":
    sys.exit(main())
