"""Training step time over an emulated WAN: DDP over gloo against ringserve, uncompressed, fp16, int8.

    sudo .venv/bin/python benchmarks/wan.py                          # DDP, none, fp16, int8
    sudo .venv/bin/python benchmarks/wan.py --codecs none fp16 --steps 4 --warmup 1

Four hosts (``--world``) run in separate network namespaces, each behind a ``--rate-mbit`` uplink
(tbf) and ``--delay-ms`` one way from every other host (a delaying TUN switch; see _netem.py for
why and how). Both frameworks see the same network: the delay is added to IP packets, under every
TCP connection. In one invocation it runs, one after the other, DDP over gloo and ringserve's
DistributedOptimizer with each of ``--codecs``, on training_step.py's MLP 784-2048-2048-10 (5.8M
parameters, 23 MB of float32 gradients), a batch of 64 per worker, one torch thread per worker.

The table gives the median step time of the slowest rank over the timed steps, its ratio to
DDP-gloo's, and the bytes on the wire: the IP bytes (headers and ACKs included) each host sent
during the timed steps, counted by the switch, divided by the number of timed steps. Warmup steps,
rendezvous and DDP's initial broadcast of the parameters are not counted. "Uplink busy" is that
rate over the step time, as a share of ``--rate-mbit``. Before the runs, two sanity lines give a
bulk TCP transfer's goodput between two hosts (what tbf lets through) and the TCP connect time (one
round trip, 2 x ``--delay-ms`` when the delay is applied).

The issue's target: ringserve with int8 at no more than 0.5x DDP-gloo's step time. Needs root, ``ip``,
``tc`` and /dev/net/tun; ``netem`` is not needed.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import PYTHON, read_json, run_ranks, table  # noqa: E402
from _netem import DEVICE, EmulationUnavailable, Host, Wan, check_environment, read_counters  # noqa: E402
from training_step import BATCH, _model  # noqa: E402

CODECS = ("none", "fp16", "int8")
_ports = itertools.count(29500)  # fresh namespaces: any port is free; a new one per run skips TIME_WAIT


def _compression(hvd: Any, codec: str) -> dict[str, Any]:
    """DistributedOptimizer keyword arguments for ``codec``."""
    if codec == "int8":
        return {"compression": hvd.Compression.int8, "error_feedback": True}
    return {"compression": getattr(hvd.Compression, codec)}


def _setup(args: argparse.Namespace, rank: int, model: Any, opt: Any) -> tuple[Any, Any, Callable[[], None], Callable[[], None]]:
    """Makes the model and optimizer distributed; returns them with a barrier and a finish function."""
    import torch

    if args.role == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank,
                                world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
        return torch.nn.parallel.DistributedDataParallel(model), opt, dist.barrier, dist.destroy_process_group
    import ringserve.torch as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), fusion_bytes=args.fusion_bytes,
                                   **_compression(hvd, args.codec))
    return model, opt, hvd.barrier, hvd.shutdown


def worker(args: argparse.Namespace) -> None:
    """One rank: warmup steps, then timed steps between two barriers, with the switch's counters read at each."""
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RINGSERVE_RANK_HINT"])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    model = _model()
    model, opt, barrier, finish = _setup(args, rank, model, torch.optim.SGD(model.parameters(), lr=0.01))

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    barrier()
    before = read_counters(args.counters)
    times = [step() for _ in range(args.steps)]
    barrier()
    after = read_counters(args.counters)
    sent = [b - a for a, b in zip(before, after, strict=True)]
    pathlib.Path(args.out).write_text(json.dumps({"step": statistics.median(times), "sent": sent}))
    finish()


def _run_ranks(wan: Wan, args: argparse.Namespace, tmp: pathlib.Path, label: str, role_argv: list[str],
               env: dict[str, str]) -> list[dict[str, Any]]:
    """Runs ``wan.py <role_argv>`` once per host, in its namespace; returns the ranks' results."""
    common = [PYTHON, str(pathlib.Path(__file__).resolve()), *role_argv, "--world", str(len(wan.hosts)),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--fusion-bytes", str(args.fusion_bytes),
              "--timeout", str(args.timeout), "--counters", wan.counters_path]
    outs = [tmp / f"{label}.{h.index}.json" for h in wan.hosts]
    argvs = [wan.command(h, [*common, "--out", str(o)], {**env, **_host_env(h)})
             for h, o in zip(wan.hosts, outs, strict=True)]
    run_ranks(argvs, {"OMP_NUM_THREADS": "1"}, timeout_s=args.timeout)
    wan.check_switch()
    return [read_json(o) for o in outs]


def _host_env(host: Host) -> dict[str, str]:
    """What makes a rank use its host's address: gloo binds DEVICE's address, ringserve the given one."""
    return {"GLOO_SOCKET_IFNAME": DEVICE, "RINGSERVE_BIND_HOST": host.address, "RINGSERVE_HOSTNAME": f"h{host.index}"}


def _run_ddp(wan: Wan, args: argparse.Namespace, tmp: pathlib.Path) -> list[dict[str, Any]]:
    role = ["--role", "ddp", "--master", wan.hosts[0].address, "--port", str(next(_ports))]
    return _run_ranks(wan, args, tmp, "ddp", role, {})


def _run_ringserve(wan: Wan, args: argparse.Namespace, codec: str, tmp: pathlib.Path) -> list[dict[str, Any]]:
    """Runs a coordinator in host 0's namespace, and the ranks against it."""
    host0, port, world = wan.hosts[0], next(_ports), str(len(wan.hosts))
    coordinator = subprocess.Popen(wan.command(host0, [PYTHON, "-m", "ringserve.cli", "coordinator", "--host",
                                                       host0.address, "--port", str(port), "--min-workers", world,
                                                       "--max-workers", world]))
    try:
        wan.wait_listening(host0, port, timeout_s=30)
        return _run_ranks(wan, args, tmp, f"ringserve-{codec}", ["--role", "ringserve", "--codec", codec],
                          {"RINGSERVE_COORDINATOR": f"{host0.address}:{port}"})
    finally:
        coordinator.terminate()
        try:
            coordinator.wait(10)
        except subprocess.TimeoutExpired:
            coordinator.kill()
            coordinator.wait()


def _available(codecs: list[str]) -> list[str]:
    """``codecs`` less those this ringserve lacks, each with a printed note."""
    from ringserve.torch import Compression

    missing = [c for c in codecs if not hasattr(Compression, c)]
    for codec in missing:
        print(f"note: ringserve.torch.Compression has no {codec!r} yet; its row is skipped")
    return [c for c in codecs if c not in missing]


def _row(config: str, ranks: list[dict[str, Any]], ddp_step: float, args: argparse.Namespace) -> dict[str, object]:
    step = max(r["step"] for r in ranks)
    per_host = [b / args.steps for b in ranks[0]["sent"]]
    mean = statistics.mean(per_host)
    return {"config": config, "step": f"{step * 1e3:.0f}", "ratio": f"{step / ddp_step:.2f}",
            "mb": f"{mean / 1e6:.1f} ({max(per_host) / 1e6:.1f})",
            "busy": f"{100 * 8 * mean / step / (args.rate_mbit * 1e6):.0f}%"}


def _sanity(wan: Wan) -> list[str]:
    a, b = wan.hosts[0], wan.hosts[1]
    nbytes = int(wan.rate_mbit * 1e6 / 8 * 2)  # about 2 s at the configured rate
    return [f"bulk TCP {a.address} -> {b.address}, {nbytes / 1e6:.0f} MB: {wan.bulk_mbit(a, b, nbytes):.1f} Mbit/s "
            f"goodput (tbf rate {wan.rate_mbit:g} Mbit/s, MTU {wan.mtu})",
            f"TCP connect {a.address} -> {b.address}: {wan.connect_rtt_ms(a, b):.1f} ms median of 5 "
            f"(one round trip; 2 x {wan.delay_ms:g} ms delay expected)"]


def _interrupt(signum: int, frame: object) -> NoReturn:
    """Turns SIGINT and SIGTERM into KeyboardInterrupt, so that every ``finally`` tears down."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS), help="ringserve compressions to run")
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay between any two hosts")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="each host's uplink rate")
    p.add_argument("--world", type=int, default=4, help="hosts, one rank each")
    p.add_argument("--fusion-bytes", type=int, default=4 << 20, help="ringserve's fusion bucket size")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed to each configuration")
    p.add_argument("--role", choices=["main", "ddp", "ringserve"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--codec", choices=CODECS, default="none", help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--counters", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = _parse()
    if args.role != "main":
        return worker(args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        check_environment()
        codecs = _available(args.codecs)
        with Wan(args.world, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as wan, \
                tempfile.TemporaryDirectory() as tmp:
            sanity = _sanity(wan)
            print("\n".join(sanity), flush=True)
            ddp = _run_ddp(wan, args, pathlib.Path(tmp))
            ddp_step = max(r["step"] for r in ddp)
            rows = [_row("DDP-gloo", ddp, ddp_step, args)]
            for codec in codecs:
                rows.append(_row(f"ringserve {codec}", _run_ringserve(wan, args, codec, pathlib.Path(tmp)),
                                 ddp_step, args))
    except EmulationUnavailable as e:
        sys.exit(f"wan.py: {e}")
    except KeyboardInterrupt as e:
        sys.exit(f"wan.py: interrupted ({e or 'SIGINT'}); the emulated network was removed")
    print(f"\n{args.world} hosts, {args.rate_mbit:g} Mbit/s uplink (tbf), {args.delay_ms:g} ms one way; MLP "
          f"784-2048-2048-10, batch {BATCH} per worker, 1 torch thread per worker, {os.cpu_count()} cores; "
          f"median step over {args.steps} timed steps after {args.warmup} warmup (slowest rank); "
          f"ringserve fusion {args.fusion_bytes >> 10} KiB; MB sent: IP bytes each host sent during the timed "
          f"steps (switch counters) / {args.steps}")
    print(table(rows, [("config", "config"), ("step", "step ms"), ("ratio", "vs DDP-gloo"),
                       ("mb", "MB sent per host per step, mean (max)"), ("busy", "uplink busy")]))
    print("\n".join(sanity))


if __name__ == "__main__":
    main()
