"""Configuration as frozen, validated dataclasses.

Environment variables are read only by the ``from_env`` constructors (and by the CLI), never at
import time, so several workers with different settings can live in one process.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ringserve.constants import ELASTIC_TIMEOUT_S
from ringserve.errors import InvalidArgumentError
from ringserve.selection import SETTINGS as ALGORITHMS
from ringserve.selection import WIDE_CHUNKS

MiB = 1 << 20

# WorkerConfig.advertise_host value meaning "my address on the route to the coordinator".
log = logging.getLogger("ringserve")

ADVERTISE_AUTO = "auto"

# The most slots a shared-memory ring has: its header page holds one state byte per slot (see
# worker/dataplane/links/shared.py, whose layout this must match; a unit test checks that it does).
MAX_SHARED_SLOTS = 4032

# WorkerConfig.payload_lane values: fall back per edge, require, or never use the TCP payload lane.
PAYLOAD_LANES = ("auto", "tcp", "off")


def route_host(coordinator: str) -> str:
    """This machine's address on the route to ``coordinator`` (host:port), as ``auto`` advertises it
    (see WorkerConfig.advertised_host)."""
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            found = str(probe.getsockname()[0])
    except (OSError, ValueError):
        found = socket.gethostbyname(socket.gethostname())
    return f"[{found}]" if ":" in found else found


# Opts a job whose coordinator other hosts reach out of the token it would get (secured_job).
INSECURE_ENV = "RINGSERVE_INSECURE"
TRUE_WORDS = ("1", "true", "yes", "on")


TOKEN_BYTES = 24  # a token made for a job: 24 random bytes, URL-safe base64 (32 characters)


def new_token() -> str:
    """A token made for one job."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name, or an address, bracketed or not) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def insecure_opted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the user opted out of the job token by name (RINGSERVE_INSECURE=1)."""
    return (os.environ if env is None else env).get(INSECURE_ENV, "").strip().lower() in TRUE_WORDS


def secured_job(config: CoordinatorConfig, *, insecure: bool | None = None) -> CoordinatorConfig:
    """The coordinator settings of a job, secure by default: every launcher and engine that starts a
    coordinator (``ringserve run``, Spark, Ray, the torch.distributed rendezvous) passes its
    settings through here.

    A coordinator bound off loopback (others can reach it) gets a token made for the job, which the
    launcher hands its workers, unless the user gave a token or a token file, or TLS that
    requires client certificates (the certificate then is the credential), or opted out by name:
    ``insecure=True`` or RINGSERVE_INSECURE=1 (``insecure`` None reads the environment). TLS
    without client certificates encrypts but lets anyone join, so it gets a token too. On
    loopback the settings are kept as they are: only this machine reaches the port.
    """
    if is_loopback(config.host):
        return config
    if config.token or config.token_file or config.tls_require_client_auth:
        return config
    if (insecure_opted() if insecure is None else insecure):
        log.warning("The coordinator on %s takes any worker that reaches it: no token, as %s asked.",
                    config.host, INSECURE_ENV if insecure is None else "insecure=True")
        return config
    return replace(config, token=new_token())


def _check_security(owner: CoordinatorConfig | WorkerConfig | ShardConfig | PSClientConfig) -> None:
    """Validates the TLS and token settings shared by both configs (files are read at start)."""
    name = type(owner).__name__
    cert, key = owner.tls_cert, owner.tls_key
    if bool(cert) != bool(key):
        raise InvalidArgumentError(
            f"{name}.tls_cert ({cert!r}) and tls_key ({key!r}) must be given together."
        )
    if owner.tls_require_client_auth and not (owner.tls_ca and cert):
        raise InvalidArgumentError(
            f"{name}.tls_require_client_auth needs tls_ca (to verify clients) and tls_cert/tls_key."
        )
    if owner.token and owner.token_file:
        raise InvalidArgumentError(f"{name}: give the token or the token file, not both.")


def _check_timeline(template: str) -> None:
    """A timeline path must name a file in a directory that exists or can be made (it is made when
    the first view is installed), so that a typo fails when the worker starts and not in the middle
    of a rendezvous (as a ViewInstallError). Whether a directory can be made there is tried, not
    guessed from its mode bits (which say yes to root under /proc): one is made and removed again in
    the nearest directory that exists."""
    name = f"WorkerConfig.timeline ({template!r}, RINGSERVE_TIMELINE)"
    try:
        path = template.format(rank=0) if "{rank}" in template else f"{template}.0.json"
    except (KeyError, IndexError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} may hold only {{rank}} in braces: {exc!r}.") from None
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InvalidArgumentError(f"{name} cannot be written: {existing!r} is not a directory.")
    try:
        probe = tempfile.mkdtemp(prefix=".ringserve-timeline-", dir=existing)
    except OSError as exc:
        raise InvalidArgumentError(
            f"{name} cannot be written: no directory can be made in {existing!r} ({exc.strerror or exc})."
        ) from None
    os.rmdir(probe)


def _check_shared_dir(directory: str) -> None:
    """The shared directory must be short enough for a Unix socket's path (whether it exists is
    checked where it is used: a worker's config may be built outside its container)."""
    # A Unix socket's path holds 107 bytes; the ring server binds in a private folder first (fdpass.py).
    longest = 107 - len("/.01234567/rs-0123456789abcdef.sock")
    if len(os.path.abspath(directory)) > longest:
        raise InvalidArgumentError(
            f"WorkerConfig.shared_dir ({directory!r}, RINGSERVE_SHARED_DIR) is longer than the {longest} "
            f"characters a Unix socket's path leaves for it."
        )


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not value > 0:
            raise InvalidArgumentError(
                f"{type(owner).__name__}.{name} ({value!r}) must be greater than zero."
            )


@dataclass(frozen=True, kw_only=True)
class SecuritySettings:
    """TLS and token settings, the same for a coordinator and a worker.

    Attributes:
        tls_cert, tls_key: PEM certificate chain and private key of this process. Set, every
            server it runs speaks TLS, and it presents them as its client certificate (mTLS).
        tls_ca: PEM bundle of the CA(s) that sign the job's certificates. Clients verify servers
            against it (the system roots when empty); with tls_require_client_auth, servers verify
            clients against it. Set, every channel this process opens speaks TLS.
        tls_require_client_auth: servers refuse clients without a certificate signed by tls_ca.
        tls_server_name: the name checked against a server's certificate instead of the host
            dialled (``grpc.ssl_target_name_override``); for certificates that do not list
            every advertised address.
        token: the shared job token, sent as ``authorization: Bearer <token>`` on every RPC and
            required by every server (health excepted); empty: no token. Never logged.
        token_file: a file holding the token (its whitespace stripped), instead of ``token``.
    """

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_require_client_auth: bool = False
    tls_server_name: str = ""
    token: str = field(default="", repr=False)
    token_file: str = ""


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig(SecuritySettings):
    """Settings of a coordinator.

    Attributes:
        host: address to bind; loopback by default.
        port: port to bind; 0 picks a free one.
        min_workers: the first view forms once this many workers have joined.
        max_workers: at most this many workers are in a view; later joiners wait.
        settle_s: membership must be unchanged this long before a view forms (torchrun's
            "last call"), so workers that start a little apart land in one view.
        heartbeat_interval_s: how often workers send heartbeats (at least; see
            max_heartbeats_per_s).
        heartbeat_timeout_s: a worker silent this long is declared dead (probed first when
            heartbeat_grace_s is set).
        heartbeat_grace_s: a worker silent for heartbeat_timeout_s is probed (its health service
            dialled) before it is declared dead: a process that is gone refuses at once and is
            removed then, while one that is only stopped or starved of CPU (a GC pause, a noisy
            neighbour, a loaded machine) has this much longer to heartbeat again (an answer to
            the probe alone does not keep it: the coordinator must hear it). A stall of up to
            heartbeat_timeout_s + heartbeat_grace_s less an interval is then never taken for a
            death, and a death is published within heartbeat_timeout_s (the process is gone) or
            heartbeat_timeout_s + heartbeat_grace_s (its host is gone, or it is wedged) of its
            last heartbeat, plus the sweep that gathers deaths found apart into one view
            (constants.SWEEP_S, 0.5 s) and a tick; see ringserve.coordinator.membership. 0:
            declared dead at the timeout, unprobed.
        max_heartbeats_per_s: the coordinator stretches the interval it hands out as the world
            grows, so that all workers together send at most this many heartbeats a second,
            but never past a third of heartbeat_timeout_s (see ringserve.coordinator.pacing); 0: never.
        tick_s: how often the coordinator checks deadlines.
        metrics_port: serve Prometheus metrics on ``host`` at this port (0: any free port);
            -1 (the default) serves none.
        http_port: serve the live status page (see ringserve/coordinator/http.py) on ``host`` at
            this port (0: any free port); -1 (the default) serves none. It needs the ``status``
            extra (aiohttp), and requires the job's token and TLS as the gRPC service does.
        tls_*, token, token_file: see SecuritySettings.
        max_concurrent_rpcs: a server answers RESOURCE_EXHAUSTED to RPCs beyond this many at
            once (a flood of streams); long-lived streams count too.
        max_param_bytes: the parameter blobs (PutParams) the coordinator holds, stored and still
            streaming together, are at most this many bytes; beyond it PutParams answers
            RESOURCE_EXHAUSTED. A blob put under a key already used replaces the old one.
        max_watch_streams: WatchView streams open at once, all clients together; never more
            than half of max_concurrent_rpcs, so that heartbeats and Status always find room.
        max_watches_per_worker: WatchView streams open at once under one worker id (a worker
            needs one; a reconnect briefly holds two).
        max_heartbeat_streams: Heartbeats streams open at once, all clients together; never
            more than a quarter of max_concurrent_rpcs. Each worker id has at most one (a newer
            one replaces it), a stream ends once it names an unknown worker or sends nothing for
            heartbeat_timeout_s, and a worker refused one heartbeats with unary calls meanwhile.
        idle_connection_s: a client connection with no RPC in flight for this long is closed
            (gRPC's max_connection_idle); a worker's WatchView stream keeps its connection busy.
        handshake_timeout_s: a connection that has not completed its TLS and HTTP/2 handshake
            within this time is closed (a socket opened and left silent).
    """

    host: str = "127.0.0.1"
    port: int = 0
    min_workers: int = 1
    max_workers: int = 1024
    settle_s: float = 0.5
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    heartbeat_grace_s: float = 2.0
    max_heartbeats_per_s: float = 1000.0
    tick_s: float = 0.1
    max_message_bytes: int = 64 * MiB
    metrics_port: int = -1
    http_port: int = -1
    # Each worker holds a WatchView and a Heartbeats stream and a unary call or two at a time:
    # 2,000 workers need about 6,000. The caps on the two kinds of stream (a half and a quarter
    # of this at most) leave a quarter to unary calls whatever floods them.
    max_concurrent_rpcs: int = 16384
    max_param_bytes: int = 1 << 30
    max_watch_streams: int = 4096
    max_watches_per_worker: int = 4
    max_heartbeat_streams: int = 4096
    idle_connection_s: float = 60.0
    handshake_timeout_s: float = 10.0

    @property
    def watch_stream_cap(self) -> int:
        """max_watch_streams, within half of max_concurrent_rpcs."""
        return max(1, min(self.max_watch_streams, self.max_concurrent_rpcs // 2))

    @property
    def heartbeat_stream_cap(self) -> int:
        """max_heartbeat_streams, within a quarter of max_concurrent_rpcs."""
        return max(1, min(self.max_heartbeat_streams, self.max_concurrent_rpcs // 4))

    def __post_init__(self) -> None:
        _positive(self, "min_workers", "max_workers", "heartbeat_interval_s",
                  "heartbeat_timeout_s", "tick_s", "max_message_bytes", "max_concurrent_rpcs",
                  "max_param_bytes", "max_watch_streams", "max_watches_per_worker",
                  "max_heartbeat_streams", "idle_connection_s", "handshake_timeout_s")
        _check_security(self)
        if self.settle_s < 0:
            raise InvalidArgumentError(f"The settle window ({self.settle_s}) must not be negative.")
        if self.heartbeat_grace_s < 0:
            raise InvalidArgumentError(
                f"The heartbeat grace heartbeat_grace_s ({self.heartbeat_grace_s}) must not be negative "
                f"(0 declares a silent worker dead at the timeout, unprobed)."
            )
        if self.max_heartbeats_per_s < 0:
            raise InvalidArgumentError(
                f"The heartbeat rate cap max_heartbeats_per_s ({self.max_heartbeats_per_s}) must not be "
                f"negative (0 turns the stretching of the interval off)."
            )
        if not -1 <= self.http_port <= 65535:
            raise InvalidArgumentError(
                f"CoordinatorConfig.http_port ({self.http_port!r}, RINGSERVE_HTTP_PORT) must be in [0, 65535], "
                f"or -1 for no status page."
            )
        if self.max_workers < self.min_workers:
            raise InvalidArgumentError(
                f"The maximum number of workers ({self.max_workers}) must be at least the "
                f"minimum ({self.min_workers})."
            )
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise InvalidArgumentError(
                f"The heartbeat timeout ({self.heartbeat_timeout_s} s) must be longer than the "
                f"heartbeat interval ({self.heartbeat_interval_s} s)."
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CoordinatorConfig:
        """Builds a config from RINGSERVE_* variables; explicit overrides win."""
        return cls(**_from_env(cls, env, overrides))


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(SecuritySettings):
    """Settings of a worker.

    Attributes:
        coordinator: host:port of the coordinator.
        bind_host: address the peer server binds.
        bind_port: port the peer server binds; 0 (the default) takes any free port. Fix it where
            a firewall or a NAT must forward a known port.
        advertise_host: address other workers use to reach this one; defaults to bind_host.
            ``auto`` is resolved when the worker starts (see ``advertised_host``).
        advertise_port: port other workers dial, where a NAT, a container or a proxy maps the
            bound port to another one; 0 (the default) advertises the bound port.
        hostname: groups workers into local ranks; defaults to the machine's name.
        rank_hint: preferred rank in the first view (the launcher's process index), or -1.
        gang, gang_size: workers admitted only together (``ringserve.torch.hsdp`` sets them: the
            ranks of one replica group): the coordinator takes a worker of gang ``gang`` into a
            view only with ``gang_size`` of them. Empty (the default): no gang.
        chunk_bytes: the ring pipelines chunks of at most this size; a ring whose ranks are all
            on hosts of their own runs a large allreduce or reduce-scatter in frames of up to four
            (selection.ring_chunk). Every worker must set the same value.
        connect_timeout_s: deadline to reach the coordinator or a peer.
        rendezvous_timeout_s: deadline for the first view that includes this worker.
        collective_timeout_s: deadline for one collective, from submission to result.
        rpc_timeout_s: deadline of each unary control-plane call.
        abort_grace_s: after a mismatch, how long ranks wait to learn every rank's arguments.
        drain_timeout_s: on shutdown or a graceful view change, how long collectives in flight
            may take to finish before they are cut off.
        use_uvloop: run the background event loop on uvloop (no measurable difference from
            asyncio's loop; see docs/design/decisions/uvloop.md).
        tune_malloc: keep chunk-sized buffers in glibc's heap instead of mmap (see _malloc.py).
        metrics_port: serve Prometheus metrics on bind_host at this port (0: any free port);
            -1 (the default) serves none.
        stall_warning_s: a collective waiting longer than this is reported with the heartbeat;
            the coordinator then logs which ranks have not submitted it (Horovod's stall
            inspector). collective_timeout_s is the later bound at which it fails.
        elastic_timeout_s: in elastic training, how long survivors wait for a new view (for
            instance while below min_workers) before they give up with a clear error.
        admit_when_ready: a worker that comes to a running world (a replacement, a scale-up) is
            admitted only once it is ready to train: its start (``init()``) returns at once,
            with the rank, size and local rank it would get if admitted now (provisional), the
            script builds its model, optimizer and data while the members train on, and the
            worker asks to be admitted at its first collective or at ``elastic.run``. False:
            the start waits for admission, and the members wait at their next commit for
            whatever the script does after it. A world that forms takes every worker at once
            either way. ``ringserve.init()`` (and ``ringserve.torch.init()``, ...) turns it on
            unless RINGSERVE_ADMIT_WHEN_READY or an override says otherwise; a ``Worker`` made
            by hand, and torch.distributed's ``init_process_group``, leave it off.
        join_timeout_s: how long join() waits for the last rank to join (the others may still be
            training on their remaining data meanwhile); collective_timeout_s still bounds each
            collective a joined rank takes part in.
        timeline: write this rank's collectives as Chrome trace events to this path
            (``{rank}`` in it is replaced, else ``.<rank>.json`` is appended); empty: none. Its
            directory must exist or be creatable (checked here, made at the first view).
        tls_*, token, token_file: see SecuritySettings.
        max_unverified_streams: peer streams that have not yet proved to come from a member of
            a view (no HELLO yet, or a HELLO not yet checked against a view) that the peer
            server holds at once; a new one past it ends the oldest (RESOURCE_EXHAUSTED), so
            streams that squat cannot keep out a member's (see worker/dataplane/gate.py). A stream whose
            HELLO is verified against this view (or a retired view) never counts.
        max_concurrent_rpcs: RPCs the peer server serves at once besides the unverified
            streams: the verified streams (one per view from each rank that sends to this one:
            the ring predecessor, and the predecessors in the sub-rings this rank is in),
            health checks and probes. gRPC's own cap is this plus max_unverified_streams; beyond
            it, every RPC gets RESOURCE_EXHAUSTED.
        peer_hello_timeout_s: a new peer stream must send a HELLO that is verified against a
            view within this; else it is aborted with DEADLINE_EXCEEDED. A new connection must
            also finish its handshake (TLS, HTTP/2 settings) within it.
        peer_idle_timeout_s: the peer server closes a connection that carried no RPC for this
            long (gRPC's max_connection_idle). A connection with an open stream (the ring's) is
            never idle.
        checksum: put a crc32 of each data frame (its routing fields and payload) in its header,
            and require one on every frame received. A frame that fails it aborts its
            collective on every rank with CorruptFrameError; it is never summed. For links
            without TLS (TLS already authenticates every byte). Every worker must agree.
        shared_memory: between workers on one host, pass payloads through a shared-memory ring
            (a memfd the successor maps) and only headers over the stream; workers on other
            hosts, or that cannot see each other's processes, fall back to the stream by
            themselves (see worker/dataplane/links/shared.py). Off: every payload travels over gRPC.
        shared_dir: a directory that every worker on this host shares, where each worker's rings
            are handed to receivers over a Unix socket (see worker/dataplane/links/fdpass.py): containers, whose
            PID namespaces hide each other's /proc, then pass payloads through shared memory too.
            A tmpfs volume mounted into every worker container (docker-compose.yml). Empty: rings
            are found through /proc only.
        shared_slots: slots in each sender's ring, each of frame_bytes (four chunks: workers on
            one host whose hostnames differ, containers, run wide frames; pages are only taken as
            payloads are written, so narrow frames use a chunk of each); when all are in use,
            payloads travel over the stream until one is freed.
        shared_release_s: a ring that has been idle this long (nothing sent, every slot free)
            gives its pages back, in both ends' memory; 0: never. Writing into given-back pages
            costs 0.6 ms a MiB instead of 0.1, so the pages stay between the steps of a training
            loop; what a burst took (a broadcast of the parameters: up to shared_slots x
            frame_bytes a ring) does not stay (see worker/dataplane/links/shared.py).
        payload_lane: the TCP payload lane between hosts (see worker/dataplane/lanes/tcp/outbound.py):
            each worker listens on one payload port, and a DATA frame's payload travels on a
            plain TCP (or, with TLS, a TLS) connection beside the gRPC stream, which still carries
            its header. ``auto`` (the default): an edge whose lane cannot connect and
            authenticate within payload_connect_timeout_s sends its payloads over the stream,
            logged once and counted (``lane_fallbacks``); ``tcp``: the lane is required, and an
            edge without it fails with PayloadLaneError naming the port; ``off``: every payload
            between hosts travels over the stream. Shared memory still wins on one host.
        payload_port: the port the payload lane listens on, on bind_host; 0 (the default) takes
            any free port. Pin it where a firewall, a NAT or a container must open a known port.
        payload_advertise_port: the payload port peers dial, where a NAT or a container maps
            payload_port to another; 0 (the default) advertises the bound port. Peers dial it at
            the host of this worker's advertised address.
        payload_connect_timeout_s: how long a receiver may take to connect to a sender's
            payload lane, finish TLS and present its token, before it falls back to the stream
            for that edge (in ``auto``).
        payload_congestion: the TCP congestion control of the lane's sending side: ``cubic``
            (the default), any other the kernel offers (``reno``, ``bbr``), or ``system`` for the
            host's default. A collective sends bursts and then waits for its peers; BBR, the default
            of some hosts, paces each burst at the bandwidth it has seen, which for bursts that
            never fill the link is a fraction of it: a 64 KiB frame took about 20 ms more per hop
            across a 20 ms link (docs/design/algorithms.md). Where the kernel refuses the name (not
            loaded, or not in net.ipv4.tcp_allowed_congestion_control for an unprivileged
            process), the lane keeps the host's, and says so once.
        hierarchical: allreduce by host (see worker/ops/hierarchy.py): a reduce-scatter among the
            workers of each host, an allreduce of each slice across hosts, an allgather within
            each host. ``auto``: when the view has more than one host (RINGSERVE_HOSTNAME) and
            the same number, more than one, of workers on each; ``1``: whenever every host has
            the same number of workers; ``0``: the flat ring always. Every worker must agree.
        algorithm: which algorithm collectives run (see ringserve/selection.py and
            docs/design/algorithms.md): ``auto`` picks, call by call, the fastest by a cost model of
            the call's size, the ring's size and its links' latency and bandwidth (measured once
            per view, or link_latency_s and link_mbps); ``ring``, ``halving_doubling``, ``tree``
            and ``ring2d`` name one (the ring where it cannot run the call). Every worker must agree.
        link_latency_s, link_mbps: the one-way latency (seconds) and bandwidth (Mbit/s) of the
            links between workers, for ``auto``; both 0 (the default): measured once per view.
        result_pool_bytes: new-result collectives (``out = allreduce(x)``) take their result
            buffers from a pool of at most this many bytes, reusing a buffer only once nothing
            outside the pool refers to it (see worker/dataplane/pool.py); it saves the page faults of a
            fresh mapping per call. 0: every result is a fresh array.
        checkpoint_dir: in elastic training, rank 0 of each view writes every checkpoint_every-th
            confirmed commit here (a local path, or any fsspec URL such as ``s3://bucket/job``,
            with fsspec installed), so that a world that loses every worker holding the last
            commit resumes from the newest copy instead of failing with StateLostError.
            ``coordinator://`` keeps the newest copy in the coordinator's parameter store (in
            its memory; under ``ringserve run`` it outlives every worker). Empty: no durable
            copies. Files are pickles: point it only at storage the job trusts.
        checkpoint_every: write one commit in this many (1: every commit). The write runs on a
            thread of its own; when commits come faster than writes, only the newest is written.
        checkpoint_keep: how many of the newest checkpoints are kept; older ones are deleted.
        checkpoint_timeout_s: when elastic training ends, how long it waits for the last
            checkpoint to be written.
        holder_wait_s: in elastic training, when a sync finds that no member of its view holds
            the job's last commit, how long it waits at most for the workers that held it to
            come back before it declares the state lost (StateLostError, or a resume from a
            durable copy). A holder may have been declared dead while alive: stopped, or starved
            on a loaded machine past the heartbeat timeout; it rejoins, and the state comes from
            it. Holders whose address refuses connections are gone at once, without a wait. The
            other ranks wait in a collective meanwhile, so the wait is capped at half of
            collective_timeout_s (see ``holder_wait_bound_s``). 0: never wait.
        commit_in_place: in elastic training with ``ringserve.torch``'s DistributedOptimizer, a
            commit copies none of the tensors that only the optimizer's step changes (the
            parameters it trains and its state): the last commit is the live model and optimizer
            until the next step. A failure surfaces in the next step's gradient allreduce, before
            that step applies, so they still hold the commit; a rank whose tensors moved past it
            (a step or an in-place change after the commit) takes the state from a rank that holds
            it. It needs a commit after every optimizer step (a second step refuses to run), and
            no collective of the script's own between ``step()`` and ``commit()``. Off (the
            default): each commit copies them, as Horovod's does.
    """

    coordinator: str = "127.0.0.1:50051"
    bind_host: str = "127.0.0.1"
    bind_port: int = 0
    advertise_host: str = ""
    advertise_port: int = 0
    hostname: str = field(default_factory=socket.gethostname)
    rank_hint: int = -1
    gang: str = ""
    gang_size: int = 0
    chunk_bytes: int = 2 * MiB
    connect_timeout_s: float = 10.0
    rendezvous_timeout_s: float = 120.0
    collective_timeout_s: float = 300.0
    rpc_timeout_s: float = 5.0
    abort_grace_s: float = 2.0
    drain_timeout_s: float = 10.0
    use_uvloop: bool = True
    tune_malloc: bool = True
    metrics_port: int = -1
    timeline: str = ""
    elastic_timeout_s: float = ELASTIC_TIMEOUT_S
    join_timeout_s: float = 3600.0
    admit_when_ready: bool = False
    stall_warning_s: float = 60.0
    max_unverified_streams: int = 16
    max_concurrent_rpcs: int = 64
    peer_hello_timeout_s: float = 10.0
    peer_idle_timeout_s: float = 60.0
    checksum: bool = False
    shared_memory: bool = True
    shared_slots: int = 32
    shared_release_s: float = 5.0
    shared_dir: str = ""
    payload_lane: str = "auto"
    payload_port: int = 0
    payload_advertise_port: int = 0
    payload_connect_timeout_s: float = 1.0
    payload_congestion: str = "cubic"
    result_pool_bytes: int = 512 * MiB
    hierarchical: str = "auto"
    algorithm: str = "auto"
    link_latency_s: float = 0.0
    link_mbps: float = 0.0
    checkpoint_dir: str = ""
    checkpoint_every: int = 1
    checkpoint_keep: int = 2
    checkpoint_timeout_s: float = 120.0
    holder_wait_s: float = 30.0
    commit_in_place: bool = False

    def __post_init__(self) -> None:
        _positive(self, "chunk_bytes", "connect_timeout_s", "rendezvous_timeout_s",
                  "collective_timeout_s", "rpc_timeout_s", "abort_grace_s", "drain_timeout_s",
                  "max_concurrent_rpcs", "max_unverified_streams", "peer_hello_timeout_s",
                  "peer_idle_timeout_s", "checkpoint_every", "checkpoint_keep", "checkpoint_timeout_s",
                  "join_timeout_s", "payload_connect_timeout_s")
        _check_security(self)
        if not 1 <= self.shared_slots <= MAX_SHARED_SLOTS:
            raise InvalidArgumentError(
                f"WorkerConfig.shared_slots ({self.shared_slots!r}) must be in [1, {MAX_SHARED_SLOTS}] "
                f"(RINGSERVE_SHARED_SLOTS): a shared ring's header holds one state byte per slot."
            )
        if not self.shared_release_s >= 0:
            raise InvalidArgumentError(
                f"WorkerConfig.shared_release_s ({self.shared_release_s!r}) must be at least 0 "
                f"(RINGSERVE_SHARED_RELEASE_S; 0: never)."
            )
        if not self.result_pool_bytes >= 0:
            raise InvalidArgumentError(
                f"WorkerConfig.result_pool_bytes ({self.result_pool_bytes!r}) must be at least 0 "
                f"(RINGSERVE_RESULT_POOL_BYTES)."
            )
        if self.hierarchical not in ("auto", "1", "0"):
            raise InvalidArgumentError(
                f"WorkerConfig.hierarchical ({self.hierarchical!r}, RINGSERVE_HIERARCHICAL) must be auto, 1 or 0."
            )
        if self.algorithm not in ALGORITHMS:
            raise InvalidArgumentError(
                f"WorkerConfig.algorithm ({self.algorithm!r}, RINGSERVE_ALGORITHM) must be one of "
                f"{', '.join(ALGORITHMS)}."
            )
        if not (self.link_latency_s >= 0 and self.link_mbps >= 0) or (self.link_latency_s > 0) != (self.link_mbps > 0):
            raise InvalidArgumentError(
                f"WorkerConfig.link_latency_s ({self.link_latency_s!r}, RINGSERVE_LINK_LATENCY_S) and link_mbps "
                f"({self.link_mbps!r}, RINGSERVE_LINK_MBPS) must both be greater than zero, or both 0 (measured)."
            )
        if self.shared_dir:
            _check_shared_dir(self.shared_dir)
        if self.timeline:
            _check_timeline(self.timeline)
        if not self.holder_wait_s >= 0:
            raise InvalidArgumentError(
                f"WorkerConfig.holder_wait_s ({self.holder_wait_s!r}) must be at least 0 (RINGSERVE_HOLDER_WAIT_S)."
            )
        if self.payload_lane not in PAYLOAD_LANES:
            raise InvalidArgumentError(
                f"WorkerConfig.payload_lane ({self.payload_lane!r}, RINGSERVE_PAYLOAD_LANE) must be one of "
                f"{', '.join(PAYLOAD_LANES)}."
            )
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,14}", self.payload_congestion):
            raise InvalidArgumentError(
                f"WorkerConfig.payload_congestion ({self.payload_congestion!r}, RINGSERVE_PAYLOAD_CONGESTION) must "
                "name a TCP congestion control (cubic, reno, bbr, ...) or be system."
            )
        for port in ("bind_port", "advertise_port", "payload_port", "payload_advertise_port"):
            if not 0 <= getattr(self, port) <= 65535:
                raise InvalidArgumentError(f"{port} ({getattr(self, port)}) must be in [0, 65535].")
        if ":" not in self.coordinator:
            raise InvalidArgumentError(
                f"The coordinator address ({self.coordinator!r}) must have the form host:port."
            )

    @property
    def holder_wait_bound_s(self) -> float:
        """How long a sync waits at most for the holders of a lost commit: holder_wait_s, within
        half of collective_timeout_s (the other ranks wait in a collective meanwhile)."""
        return min(self.holder_wait_s, self.collective_timeout_s / 2)

    @property
    def frame_bytes(self) -> int:
        """Largest payload of a frame: a chunk, or a ring's wider chunk between hosts
        (selection.ring_chunk)."""
        return WIDE_CHUNKS * self.chunk_bytes

    @property
    def max_message_bytes(self) -> int:
        """Largest frame accepted on the data plane: frame_bytes plus room for its header."""
        return self.frame_bytes + 64 * 1024

    @property
    def stream_window_bytes(self) -> int:
        """How far ahead a peer stream reads (gRPC's lookahead): four chunks and their headers."""
        return 4 * (self.chunk_bytes + 64 * 1024)

    @property
    def server_rpc_cap(self) -> int:
        """gRPC's cap on the peer server's RPCs: room for every unverified stream and, apart from
        them, max_concurrent_rpcs for the ring's verified streams and probes."""
        return self.max_concurrent_rpcs + self.max_unverified_streams

    def advertised_host(self) -> str:
        """The host other workers dial to reach this one.

        ``advertise_host`` if set, else ``bind_host``. ``auto`` means the address of this
        machine's interface that routes to the coordinator, so a worker in a container advertises
        its own address on the network it shares with the coordinator (``docker compose
        --scale``), whatever it is named. It is found by connecting a UDP socket, which sends
        nothing; if the coordinator's name does not resolve, the machine's name is used instead.
        """
        if self.advertise_host != ADVERTISE_AUTO:
            return self.advertise_host or self.bind_host
        return route_host(self.coordinator)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> WorkerConfig:
        """Builds a config from RINGSERVE_* variables (RINGSERVE_COORDINATOR, ...); overrides win.

        Without RINGSERVE_RANK_HINT, torch's RANK (torchrun's, or a torch.distributed launch's) is
        the hint: a process that calls ``ringserve.torch.init()`` before ``init_process_group`` then
        takes the rank torch gives it.
        """
        values = _from_env(cls, env, overrides)
        torch_rank = (os.environ if env is None else env).get("RANK", "")
        if "rank_hint" not in values and torch_rank.isdigit():
            values["rank_hint"] = int(torch_rank)
        return cls(**values)


def _from_env(cls: type, env: Mapping[str, str] | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for f in fields(cls):
        raw = env.get(f"RINGSERVE_{f.name.upper()}")
        if raw is None or raw == "":
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        try:
            if kind == "bool":
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif kind == "int":
                values[f.name] = int(raw)
            elif kind == "float":
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        except ValueError:
            raise InvalidArgumentError(
                f"RINGSERVE_{f.name.upper()} ({raw!r}) is not a valid {kind}."
            ) from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


@dataclass(frozen=True, kw_only=True)
class ShardConfig(SecuritySettings):
    """Settings of one parameter-server shard (``ringserve ps``, ringserve.ps.Shard).

    Attributes:
        coordinator: host:port of the coordinator, the shards' directory.
        bind_host, bind_port: where the shard's server listens (port 0: any free one).
        advertise_host, advertise_port: the address workers dial, when not the bound one
            (``auto``: this machine's address on the route to the coordinator, as for workers).
        shards: S, the job's number of shards; every shard and the directory must agree.
        shard_index: the index this shard asks for; -1 (the default) takes the lowest free one,
            or one whose shard's lease lapsed (a container restarted by its policy).
        checkpoint_dir: write a checkpoint of the shard every checkpoint_updates updates under
            this directory (``<dir>/ps/shard-<i>-of-<S>/``), and resume from the newest one
            there when the shard starts. Empty: none; a shard that restarts empty is then seeded
            again by the first worker that finds it so, from the values it last pulled.
        checkpoint_updates: K: a checkpoint after every K updates applied (K rounds in sync).
        checkpoint_keep: the newest checkpoints kept; older ones are deleted.
        chunk_bytes: pulled values stream in chunks of at most this size.
        connect_timeout_s: deadline of each call to reach the coordinator.
        register_timeout_s: how long a starting shard tries to take its index: while the
            coordinator does not answer yet, or while the index is held by a shard whose lease
            has not lapsed (the one it replaces).
        rpc_timeout_s: deadline of each call to the coordinator (registration, its refresh).
        max_wait_s: the longest a pull or a push waits on the shard (for a round, a view, the
            staleness gate), whatever the caller's deadline; it then fails with DEADLINE_EXCEEDED.
        max_shard_bytes: an Init that would make this shard hold more is refused.
        max_push_bytes: the bytes that pushes and Inits in flight hold together (their payloads,
            and a codec's decoded values); a push past it waits for room, at most max_wait_s,
            then fails with RESOURCE_EXHAUSTED naming it. One push larger than the budget runs
            alone, so that no shard refuses its own model.
        max_concurrent_rpcs: calls served at once; beyond it, RESOURCE_EXHAUSTED.
        use_uvloop: run the shard's event loop on uvloop.
        tls_*, token, token_file: see SecuritySettings.
    """

    coordinator: str = "127.0.0.1:50051"
    bind_host: str = "127.0.0.1"
    bind_port: int = 0
    advertise_host: str = ""
    advertise_port: int = 0
    shards: int = 1
    shard_index: int = -1
    checkpoint_dir: str = ""
    checkpoint_updates: int = 100
    checkpoint_keep: int = 2
    chunk_bytes: int = 2 * MiB
    connect_timeout_s: float = 10.0
    register_timeout_s: float = 60.0
    rpc_timeout_s: float = 5.0
    max_wait_s: float = 300.0
    max_shard_bytes: int = 16 << 30
    max_push_bytes: int = 2 << 30
    max_concurrent_rpcs: int = 256
    use_uvloop: bool = True

    def __post_init__(self) -> None:
        _positive(self, "shards", "checkpoint_updates", "checkpoint_keep", "chunk_bytes", "connect_timeout_s",
                  "register_timeout_s", "rpc_timeout_s", "max_wait_s", "max_shard_bytes", "max_push_bytes",
                  "max_concurrent_rpcs")
        _check_security(self)
        if not -1 <= self.shard_index < self.shards:
            raise InvalidArgumentError(
                f"ShardConfig.shard_index ({self.shard_index}, RINGSERVE_SHARD_INDEX) must be in [0, {self.shards}) "
                f"or -1 (any free index)."
            )
        for port in ("bind_port", "advertise_port"):
            if not 0 <= getattr(self, port) <= 65535:
                raise InvalidArgumentError(f"{port} ({getattr(self, port)}) must be in [0, 65535].")
        if ":" not in self.coordinator:
            raise InvalidArgumentError(f"The coordinator address ({self.coordinator!r}) must have the form host:port.")

    @property
    def max_message_bytes(self) -> int:
        """Largest message a shard sends or takes: a chunk and room for its header."""
        return self.chunk_bytes + 64 * 1024

    def advertised_host(self) -> str:
        if self.advertise_host != ADVERTISE_AUTO:
            return self.advertise_host or self.bind_host
        return route_host(self.coordinator)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ShardConfig:
        """Builds a config from RINGSERVE_* variables (RINGSERVE_SHARDS, RINGSERVE_CHECKPOINT_DIR, ...)."""
        return cls(**_from_env(cls, env, overrides))


@dataclass(frozen=True, kw_only=True)
class PSClientConfig(SecuritySettings):
    """Settings of a parameter-server client (ringserve.ps.Client, ParameterServerOptimizer).

    Attributes:
        coordinator: host:port of the coordinator, where the shards are listed.
        chunk_bytes: pushed and initial values stream in chunks of at most this size.
        push_codec: the wire codec of pushed gradients and deltas (none, fp16, bf16, int8; see
            ringserve/codecs.py). Pulled values are always sent whole.
        connect_timeout_s: deadline of each call to a shard that does not wait on others.
        rpc_timeout_s: deadline of each call to the coordinator.
        round_timeout_s: how long a pull may wait for its round (sync, average) or for the
            slowest worker (ssp), and a push for the shard to hear of the worker's view; then
            CollectiveTimeoutError, naming the shard and the members it waits for.
        shard_wait_s: how long to wait for every shard to be listed alive: at start, and when a
            shard stops answering (it restarts and registers again); then ShardUnavailableError.
        tls_*, token, token_file: see SecuritySettings (a worker's client takes the worker's).
    """

    coordinator: str = "127.0.0.1:50051"
    chunk_bytes: int = 1 * MiB
    push_codec: str = "none"
    connect_timeout_s: float = 10.0
    rpc_timeout_s: float = 5.0
    round_timeout_s: float = 300.0
    shard_wait_s: float = 60.0

    def __post_init__(self) -> None:
        from ringserve.codecs import codec

        _positive(self, "chunk_bytes", "connect_timeout_s", "rpc_timeout_s", "round_timeout_s", "shard_wait_s")
        _check_security(self)
        codec(self.push_codec)  # names the bad codec
        if ":" not in self.coordinator:
            raise InvalidArgumentError(f"The coordinator address ({self.coordinator!r}) must have the form host:port.")

    @property
    def max_message_bytes(self) -> int:
        """Largest message received: a shard's chunk is at most ShardConfig.chunk_bytes (64 MiB of
        room, so that a shard's larger chunks still pass)."""
        return max(self.chunk_bytes, 64 * MiB) + 64 * 1024

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PSClientConfig:
        """Builds a config from RINGSERVE_* variables (RINGSERVE_PUSH_CODEC, ...); overrides win."""
        return cls(**_from_env(cls, env, overrides))
