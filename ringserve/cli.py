"""The ``ringserve`` command: ``coordinator``, ``run``, ``ps`` and ``status``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from google.protobuf import json_format

from ringserve.config import INSECURE_ENV, CoordinatorConfig, WorkerConfig, secured_job
from ringserve.constants import ELASTIC_TIMEOUT_S, REMOTE_START_TIMEOUT_S
from ringserve.errors import STATE_LOST_EXIT_CODE, InvalidArgumentError, RingserveError, UsageError


def _coordinator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=None, help="port to bind (default 0: any free port)")
    p.add_argument("--min-workers", type=int, default=None, help="workers needed for the first view")
    p.add_argument("--max-workers", type=int, default=None, help="most workers in one view")
    p.add_argument("--settle-seconds", dest="settle_s", type=float, default=None,
                   help="membership must be stable this long before a view forms")
    p.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float, default=None)
    p.add_argument("--heartbeat-timeout", dest="heartbeat_timeout_s", type=float, default=None)
    p.add_argument("--heartbeat-grace", dest="heartbeat_grace_s", type=float, default=None,
                   help="a worker silent for the timeout is probed, and has this much longer to answer (0: none)")
    p.add_argument("--max-heartbeats-per-second", dest="max_heartbeats_per_s", type=float, default=None,
                   help="stretch the heartbeat interval as the world grows to keep under this rate, "
                        "within a third of the timeout (default 1000; 0: never)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the live status page on this port (0: any free port; needs ringserve[status])")
    p.add_argument("--max-concurrent-rpcs", type=int, default=None,
                   help="answer RESOURCE_EXHAUSTED beyond this many RPCs at once (default 16384)")
    p.add_argument("--max-param-bytes", type=int, default=None,
                   help="bytes of parameter blobs held at once, streaming ones included (default 1 GiB)")
    p.add_argument("--max-watch-streams", type=int, default=None,
                   help="WatchView streams open at once, all clients together (default 4096)")
    p.add_argument("--max-watches-per-worker", type=int, default=None,
                   help="WatchView streams open at once under one worker id (default 4)")
    p.add_argument("--max-heartbeat-streams", type=int, default=None,
                   help="Heartbeats streams open at once, all clients together (default 4096)")
    p.add_argument("--idle-connection-seconds", dest="idle_connection_s", type=float, default=None,
                   help="close a client connection with no RPC in flight for this long (default 60)")
    p.add_argument("--handshake-timeout-seconds", dest="handshake_timeout_s", type=float, default=None,
                   help="close a connection that has not completed its handshake in time (default 10)")
    _security_args(p, server=True)
    p.add_argument("--make-token", default=None, metavar="PATH",
                   help="serve with the token in PATH, made there (owner-only) if it is not there yet, for "
                        "workers that read the same file (RINGSERVE_TOKEN_FILE; a volume they share)")


def _security_args(p: argparse.ArgumentParser, *, server: bool) -> None:
    """TLS and token flags; each falls back on its RINGSERVE_* variable (RINGSERVE_TLS_CERT, ...)."""
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain of this process (TLS on)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle that signs the job's certificates")
    if server:
        p.add_argument("--tls-require-client-auth", action="store_true", default=None,
                       help="refuse clients without a certificate signed by --tls-ca (mTLS)")
    p.add_argument("--tls-server-name", default=None,
                   help="name to check servers' certificates against instead of the host dialled")
    p.add_argument("--token-file", default=None,
                   help="file holding the job token (or set RINGSERVE_TOKEN); never logged")


_SECURITY_FIELDS = ("tls_cert", "tls_key", "tls_ca", "tls_require_client_auth", "tls_server_name", "token_file")


def _overrides(ns: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    return {n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None}


_COORD_FIELDS = ("host", "port", "min_workers", "max_workers", "settle_s", "heartbeat_interval_s",
                 "heartbeat_timeout_s", "heartbeat_grace_s", "max_heartbeats_per_s", "metrics_port", "http_port", "max_concurrent_rpcs", "max_param_bytes",
                 "max_watch_streams", "max_watches_per_worker", "max_heartbeat_streams", "idle_connection_s",
                 "handshake_timeout_s", *_SECURITY_FIELDS)


async def _serve(config: CoordinatorConfig) -> None:
    from ringserve.coordinator import Coordinator

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Coordinator(config, release_memory=True) as coord:
        mode = "plaintext"
        if coord.security.tls:
            mode = "mTLS" if coord.security.require_client_auth else "TLS"
        token = ", token required" if coord.security.token else ""
        print(f"ringserve coordinator listening on {coord.address} ({mode}{token})", flush=True)
        if coord.metrics is not None:
            print(f"ringserve coordinator metrics on {coord.metrics.url}", flush=True)
        if coord.status_page is not None:
            print(f"ringserve coordinator status page on {coord.status_page.url}", flush=True)
        await stop.wait()


def standalone_config(config: CoordinatorConfig, make_token: str) -> CoordinatorConfig:
    """A coordinator started by hand, secure by default (config.secured_job): off loopback it
    needs a credential, and as it has no workers of its own to hand a token to, it refuses to start
    without one rather than make one nobody knows, unless ``make_token`` names a file to make it in
    (or keep it from, on a restart) that its workers read too.

    Raises:
        UsageError: off loopback with no token, token file, client certificates or opt-out, or
            ``make_token`` beside a token of the user's.
    """
    if make_token:
        from ringserve.security import token_file_made  # grpc: only for a coordinator that serves

        if config.token or config.token_file:
            raise UsageError("--make-token makes the job's token: give it, or a token (file), not both.")
        return replace(config, token_file=token_file_made(make_token))
    if secured_job(config).token != config.token:
        raise UsageError(
            f"A coordinator on {config.host} would take any worker that reaches it. Give it the job's token "
            f"(RINGSERVE_TOKEN or --token-file), or --make-token PATH to make one there for the workers to "
            f"read, or require client certificates (--tls-require-client-auth), or opt out by name with "
            f"{INSECURE_ENV}=1."
        )
    return config


def _cmd_coordinator(ns: argparse.Namespace) -> int:
    from ringserve import _malloc
    from ringserve.loop import new_event_loop

    config = standalone_config(CoordinatorConfig.from_env(**_overrides(ns, _COORD_FIELDS)), ns.make_token or "")
    _malloc.return_large_frees()
    loop = new_event_loop(use_uvloop=True)
    try:
        loop.run_until_complete(_serve(config))
    finally:
        loop.close()
    return 0


# With --ps the first view forms once one worker joined (min-np 1): a longer settle window lets
# the -np workers that start together land in it, instead of waiting to be admitted at a step.
PS_SETTLE_S = 1.0

_SECURITY_ENV = {f"RINGSERVE_{f.upper()}" for f in (*_SECURITY_FIELDS, "token")}


def _placement(ns: argparse.Namespace) -> Any:
    """horovodrun's host arguments as a Placement; None when none was given (all on this host)."""
    from ringserve.launch import Placement
    from ringserve.launch.hosts import parse_host_list, parse_hostfile
    from ringserve.launch.procs import SshSettings

    ssh = SshSettings(port=ns.ssh_port, identity_file=ns.ssh_identity_file or "", config_file=ns.ssh_config_file or "",
                      start_timeout_s=ns.start_timeout)
    slots = ns.slots_per_host or 1
    if ns.hosts:
        hosts = tuple(parse_host_list(ns.hosts, slots))
    elif ns.hostfile:
        try:
            with open(ns.hostfile) as f:
                text = f.read()
        except OSError as exc:
            raise InvalidArgumentError(f"The hostfile {ns.hostfile!r} cannot be read: {exc.strerror}.") from None
        hosts = tuple(parse_hostfile(text, ns.hostfile, slots))
    elif ns.host_discovery_script:
        hosts = ()
    else:
        return None
    cooldown = None
    if ns.blacklist_cooldown_range:
        low, high = ns.blacklist_cooldown_range
        cooldown = (low, high)
    return Placement(hosts=hosts, discovery_script=ns.host_discovery_script or "", slots_per_host=slots, ssh=ssh,
                     advertise_host=ns.advertise_host or "", cooldown_range=cooldown,
                     elastic_timeout_s=ns.elastic_timeout, verbose=ns.verbose)


def _cmd_run(ns: argparse.Namespace) -> int:
    from ringserve.launch import launch

    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    # With shards, workers are independent: a dead one leaves the others training.
    min_np = ns.min_np if ns.min_np is not None else (1 if ns.ps else ns.np)
    max_np = ns.max_np if ns.max_np is not None else ns.np
    if ns.start_timeout is None:
        ns.start_timeout = float(os.environ.get("HOROVOD_START_TIMEOUT") or REMOTE_START_TIMEOUT_S)
    if ns.elastic_timeout is None:
        ns.elastic_timeout = float(os.environ.get("HOROVOD_ELASTIC_TIMEOUT") or ELASTIC_TIMEOUT_S)
    placement = _placement(ns)
    # The embedded coordinator takes the job's TLS and token from the environment, as the
    # workers it starts do.
    security = CoordinatorConfig.from_env(
        {k: v for k, v in os.environ.items() if k in _SECURITY_ENV}
    )
    config = CoordinatorConfig(
        host=ns.host or "127.0.0.1",
        min_workers=min_np,
        max_workers=max(max_np, ns.np),
        settle_s=PS_SETTLE_S if ns.ps else 0.2,
        heartbeat_timeout_s=ns.heartbeat_timeout,
        http_port=ns.http_port,
        **{f: getattr(security, f) for f in (*_SECURITY_FIELDS, "token")},
    )
    env = dict(os.environ)
    env.setdefault("RINGSERVE_ELASTIC_TIMEOUT_S", f"{ns.elastic_timeout:g}")
    elastic = min_np < ns.np or ns.restart_failed or bool(ns.host_discovery_script)
    # This process only launches and coordinates: its large frees go back to the system, as a
    # coordinator's own do. Without it, glibc's adaptive threshold let a flood's freed 34 MiB sit
    # at the top of a gRPC thread's arena, where malloc_trim does not reach (test_launcher_memory).
    from ringserve import _malloc

    _malloc.return_large_frees()
    outcome = launch(ns.np, command, coordinator=config, env=env, elastic=elastic, placement=placement,
                     restart_failed=ns.restart_failed, max_restarts=ns.max_restarts, ps_shards=ns.ps)
    if outcome.reason:
        lost = " (StateLostError: the job's committed state is lost)" if outcome.code == STATE_LOST_EXIT_CODE else ""
        stopped = "; the other ranks were stopped." if outcome.failed_rank is not None else "."
        print(f"ringserve run: {outcome.reason}{lost}{stopped}", file=sys.stderr)
    return outcome.code


def _format_status(status: object) -> str:
    from ringserve._proto import coordinator_pb2 as pb

    assert isinstance(status, pb.StatusResponse)
    size = status.view_size or len(status.view.members)
    lines = [
        f"view {status.view.view_id}, {size} workers "
        f"(min {status.min_workers}, max {status.max_workers}, {status.pending_workers} waiting); "
        f"views formed {status.views_formed}; uptime {status.uptime_s:.1f} s",
    ]
    if status.members:
        beats = sorted(m.seconds_since_heartbeat for m in status.members)
        lines.append(
            f"heartbeats of the {len(beats)} listed: newest {beats[0]:.1f} s ago, "
            f"median {beats[len(beats) // 2]:.1f} s, oldest {beats[-1]:.1f} s"
        )
    header = (f"{'rank':>4}  {'address':<22} {'host':<16} {'heartbeat':>10} {'collectives':>12} {'sent':>12} "
              f"{'received':>12} {'lane sent':>12} {'lane fallbacks':>14}")
    lines.append(header)
    lines.extend(
        f"{m.member.rank:>4}  {m.member.address:<22} {m.member.hostname[:16]:<16} "
        f"{m.seconds_since_heartbeat:>8.1f} s {m.counters.collectives_done:>12} "
        f"{_human(m.counters.bytes_sent):>12} {_human(m.counters.bytes_received):>12} "
        f"{_human(m.counters.lane_bytes_sent):>12} {m.counters.lane_fallbacks:>14}"
        for m in status.members
    )
    if len(status.members) < size:
        lines.append(f"... {size - len(status.members)} more (--all lists every worker)")
    return "\n".join(lines)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _cmd_status(ns: argparse.Namespace) -> int:
    from ringserve._proto import coordinator_pb2
    from ringserve.worker.control.client import ControlClient

    async def fetch() -> coordinator_pb2.StatusResponse:
        env = {k: v for k, v in os.environ.items() if k in _SECURITY_ENV}
        config = WorkerConfig.from_env(env, coordinator=ns.coordinator, rpc_timeout_s=ns.timeout,
                                       **_overrides(ns, _SECURITY_FIELDS))
        client = ControlClient(config)
        try:
            # A table of 2,000 workers helps nobody: the first ones, unless --all (JSON: all).
            limit = 0 if ns.all or ns.json else ns.limit
            return await client.status(limit=limit)
        finally:
            await client.close()

    status = asyncio.run(fetch())
    if ns.json:
        print(json.dumps(json_format.MessageToDict(status, always_print_fields_with_no_presence=True), indent=2))
    else:
        print(_format_status(status))
    return 0


_PS_FIELDS = ("coordinator", "shards", "shard_index", "bind_host", "bind_port", "advertise_host", "advertise_port",
              "checkpoint_dir", "checkpoint_updates", "checkpoint_keep", "max_wait_s", *_SECURITY_FIELDS)


def _ps_args(p: argparse.ArgumentParser) -> None:
    """``ringserve ps``'s flags; each falls back on its RINGSERVE_* variable."""
    p.add_argument("--shards", type=int, default=None, help="S, the job's number of shards (default 1)")
    p.add_argument("--coordinator", default=None, help="host:port of the coordinator, the shards' directory")
    p.add_argument("--one-shard", action="store_true",
                   help="run one shard of S in this process (a container's; default: all S, one process each)")
    p.add_argument("--shard-index", type=int, default=None,
                   help="with --one-shard: the index to take (default -1: the lowest free one)")
    p.add_argument("--shard-id", default="", help=argparse.SUPPRESS)  # ringserve ps's children keep theirs
    p.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)  # and stop when it is gone
    p.add_argument("--bind-host", default=None, help="address the shards bind (default 127.0.0.1)")
    p.add_argument("--bind-port", type=int, default=None, help="with --one-shard: port to bind (default any)")
    p.add_argument("--advertise-host", default=None, help="address workers dial ('auto': the route to the coordinator)")
    p.add_argument("--advertise-port", type=int, default=None, help="port workers dial, where it is mapped")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint every --checkpoint-updates updates here, and resume from it (RINGSERVE_CHECKPOINT_DIR)")
    p.add_argument("--checkpoint-updates", type=int, default=None, help="updates between checkpoints (default 100)")
    p.add_argument("--checkpoint-keep", type=int, default=None, help="checkpoints kept per shard (default 2)")
    p.add_argument("--max-wait-seconds", dest="max_wait_s", type=float, default=None,
                   help="the longest a pull or push waits on a shard for a round or the slowest worker (default 300)")
    _security_args(p, server=True)


def _cmd_ps(ns: argparse.Namespace) -> int:
    from ringserve.config import ShardConfig
    from ringserve.launch.shards import serve

    config = ShardConfig.from_env(**_overrides(ns, _PS_FIELDS))
    return serve(config, one_shard=ns.one_shard or config.shards == 1, shard_id=ns.shard_id, parent=ns.parent)


def _cmd_timeline_merge(ns: argparse.Namespace) -> int:
    from ringserve.observe import merge_traces

    count = merge_traces(ns.inputs, ns.output)
    print(f"wrote {count} events from {len(ns.inputs)} files to {ns.output}")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    """``ringserve run``'s flags: horovodrun's names where horovodrun has the flag."""
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="number of workers (elastic: the slots needed before training starts)")
    p.add_argument("--host", default=None,
                   help="address the coordinator binds (default 127.0.0.1; 0.0.0.0 when workers run on other hosts)")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=None,
                   help="elastic: the world goes on while at least this many workers live (default -np)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=None,
                   help="elastic: at most this many workers in a view (default -np)")
    p.add_argument("--restart-failed", action="store_true",
                   help="start a failed worker again; it rejoins at the next commit (elastic). A worker that "
                        "exits with 65 (StateLostError) is never restarted: the run ends with 65")
    p.add_argument("--max-restarts", type=int, default=10, help="with --restart-failed: restarts in all")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds of silence before a worker is declared dead")
    p.add_argument("--ps", type=int, default=0, metavar="S",
                   help="also run S parameter-server shards (ringserve.ps) on this host; workers that die leave "
                        "the others training (--min-np defaults to 1)")
    p.add_argument("--http-port", type=int, default=-1,
                   help="serve the coordinator's live status page on this port of --host (needs ringserve[status])")
    hosts = p.add_argument_group("hosts (as horovodrun)")
    one = hosts.add_mutually_exclusive_group()
    one.add_argument("-H", "--hosts", default=None,
                     help="hosts and their slots, host1:4,host2:4 (ranks fill host1 first); workers on other "
                          "hosts start over ssh")
    one.add_argument("-hostfile", "--hostfile", default=None,
                     help="a file of hosts, one 'host slots=4' per line")
    one.add_argument("--host-discovery-script", default=None,
                     help="elastic: a command printing one 'host:slots' (or 'host') per line, run every second")
    hosts.add_argument("--slots-per-host", type=int, default=None,
                       help="slots of a host given without them (default 1)")
    hosts.add_argument("-p", "--ssh-port", type=int, default=None, help="the ssh port on every host")
    hosts.add_argument("-i", "--ssh-identity-file", default=None, help="the private key ssh logs in with")
    hosts.add_argument("--ssh-config-file", default=None, help="an ssh config file to use instead of ~/.ssh/config")
    hosts.add_argument("--start-timeout", type=float, default=None,
                       help=f"seconds a remote worker may take to start (default {REMOTE_START_TIMEOUT_S:g}, or "
                            "HOROVOD_START_TIMEOUT)")
    hosts.add_argument("--elastic-timeout", type=float, default=None,
                       help="elastic: seconds to wait for -np slots, and for a new view "
                            f"(default {ELASTIC_TIMEOUT_S:g}, or HOROVOD_ELASTIC_TIMEOUT)")
    hosts.add_argument("--blacklist-cooldown-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                       help="elastic: a failing host stays out MIN seconds, doubling with each failure up to MAX "
                            "(default: for good)")
    hosts.add_argument("--advertise-host", default=None,
                       help="this host's address for workers on other hosts (default: the address their ssh "
                            "connection came from)")
    hosts.add_argument("--verbose", action="store_true", help="note each ssh command as it starts")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, e.g. python train.py")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringserve", description="Collective communication over gRPC.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("coordinator", help="run a coordinator until SIGINT or SIGTERM")
    _coordinator_args(p)
    p.set_defaults(func=_cmd_coordinator)

    p = sub.add_parser("run", help="run a command as N workers of a fresh coordinator, here or on several hosts")
    _run_args(p)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("ps", help="run parameter-server shards (ringserve.ps) until SIGINT or SIGTERM")
    _ps_args(p)
    p.set_defaults(func=_cmd_ps)

    p = sub.add_parser("status", help="show the current view and each worker's counters")
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (every worker)")
    p.add_argument("--all", action="store_true", help="list every worker, not only the first --limit")
    p.add_argument("--limit", type=int, default=20, help="workers listed in the table (default 20)")
    p.add_argument("--timeout", type=float, default=5.0, help="deadline in seconds")
    _security_args(p, server=False)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("timeline", help="work with timeline files (RINGSERVE_TIMELINE)")
    tsub = p.add_subparsers(dest="timeline_cmd", required=True)
    m = tsub.add_parser("merge", help="combine the ranks' timeline files into one trace")
    m.add_argument("output", help="the merged trace to write")
    m.add_argument("inputs", nargs="+", help="the ranks' files")
    m.set_defaults(func=_cmd_timeline_merge)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(ns.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(ns.func(ns))
    except RingserveError as exc:
        print(f"ringserve {ns.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
