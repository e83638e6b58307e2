"""A parameter-server worker process: joins the world, trains the least-squares task (tests/ps/lsq.py)
through ringserve.ps.Client, and appends one JSON line per step to --out."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from lsq import START, gradients, task

import ringserve as rs
from ringserve.ps import Client, Optimizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="sync")
    p.add_argument("--steps", type=int, default=20, help="0: until killed")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rs.init()
    out = pathlib.Path(args.out)
    ps = Client(START, mode=args.mode, optimizer=Optimizer(kind="sgd", lr=0.05), staleness=args.staleness)
    x, y = task(rs.rank())
    step = 0
    while not args.steps or step < args.steps:
        loss, grads = gradients(ps.values, x, y)
        time.sleep(args.sleep)
        outcomes = ps.push(grads)
        ps.pull()
        with out.open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "versions": ps.versions, "outcomes": outcomes,
                                "rank": rs.rank(), "size": rs.size(), "pid": os.getpid()}) + "\n")
        step += 1
    ps.close()
    rs.shutdown()


if __name__ == "__main__":
    main()
