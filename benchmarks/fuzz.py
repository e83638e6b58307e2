"""The fuzz campaign: seeded, replayable inputs at every port of a live job.

    .venv/bin/python benchmarks/fuzz.py --inputs 100000 --seed 1            # the full campaign
    .venv/bin/python benchmarks/fuzz.py --inputs 300 --seed 1               # the default suite's
    .venv/bin/python benchmarks/fuzz.py --replay lane:4711 --seed 1         # one input again

A target process (benchmarks/fuzz_target.py) holds a job on loopback with a token: a coordinator
with its status page, three workers (two on one host, sharing a directory: the fd-passing socket;
one on another: the TCP payload lanes) allreducing and checking every sum, and a
parameter-server shard that a client pushes to. The campaign sends ``--inputs`` inputs to each
surface, one at a time, each with a deadline:

========== ===================================================================================
surface    inputs
========== ===================================================================================
coordinator every RPC with mutated protobufs (bit flips, cuts, garbage, repeated and unknown
           fields, oversized fields), streams cut short, no token, a wrong one, a replayed one
           (another job's), and the right token only on read-only calls and on bytes that no
           message parses from (a holder of the token is a member: not this campaign's attacker)
peer       the workers' Stream with mutated frames (a HELLO, frames of a collective, garbage),
           with the same tokens; Latest
lane       raw TCP at the payload ports: garbage, the hello cut anywhere, wrong and replayed
           tokens, a TLS ClientHello, silence, bytes one at a time
fdsock     raw Unix connections to the fd-passing sockets: garbage, tokens cut short, wrong ones
shard      the shard's Init, Push, Pull and Info, mutated as the coordinator's
status     raw HTTP/1.1 at the status page: methods, paths, Host, Cookie, Authorization and
           Content-Length drawn at random, bodies, malformed request lines, headers cut short
========== ===================================================================================

Input ``i`` of a surface is drawn from ``random.Random(f"{seed}:{surface}:{i}")`` alone, so any
input can be sent again by itself (``--replay``). The campaign counts, per surface:

- **crashes**: the target process died;
- **hangs**: an input that got neither an answer nor a close within its deadline (a server's own
  deadline, its hello or handshake bound, plus 2 s);
- **faults**: an answer no client can act on: gRPC UNKNOWN or INTERNAL from a handler (a
  request gRPC could not parse is INTERNAL too, with its own details, and is not counted), an
  HTTP 5xx;
- **stalls**: the job's collectives or pushes made no progress for ``STALL_S``;
- and the target's peak RSS (VmHWM) after each surface, and at the end.

Exits 1 on any crash, hang, fault or stall. The default suite runs 300 inputs a surface
(tests/security/test_fuzz_campaign.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve._proto import coordinator_pb2 as cpb  # noqa: E402
from ringserve._proto import peer_pb2, ps_pb2  # noqa: E402

SURFACES = ("coordinator", "peer", "lane", "fdsock", "shard", "status")
DEADLINE_S = 3.0  # a unary RPC's deadline: it must be answered by then
STREAM_S = 0.3  # a call that streams answers (a watch) may go on: it is cut after this
HELLO_S = 2.0  # the target's peer_hello_timeout_s: a raw connection must be closed by then
FD_TIMEOUT_S = 5.0  # the target's connect_timeout_s: the fd socket's bound on a silent connection
PAGE_BOUND_S = 10.0 + 0.5 + 2  # the status page's REQUEST_S (IDLE_S is shorter), its guard's period, and 2 s
STALL_S = 20.0
CHECK_EVERY = 200  # inputs between looks at the target
OLD_TOKEN = "another-jobs-token-that-was-seen-once"
BAD_BUT_PARSED = {"Exception deserializing request!", "Exception iterating requests!"}
MAGIC = b"RSLANE2\0"


def identity(b: bytes) -> bytes:
    return b


# -- drawing inputs ------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes) -> bytes:
    """``data`` changed as a fuzzer would: flips, cuts, insertions, repeats, or replaced outright."""
    kind = rng.randrange(8)
    b = bytearray(data)
    if kind == 0 or not b:
        return rng.randbytes(rng.choice((0, 1, 7, 64, 1024, 65536)))
    if kind == 1:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:
        return bytes(b[: rng.randrange(len(b))])
    if kind == 3:
        i = rng.randrange(len(b) + 1)
        return bytes(b[:i] + rng.randbytes(rng.randint(1, 32)) + b[i:])
    if kind == 4:
        return bytes(b * rng.randint(2, 5))
    if kind == 5:  # an unknown field of every wire type
        return bytes(b) + bytes([0xF8 | rng.randrange(6), 0x7F]) + rng.randbytes(rng.randint(0, 9))
    if kind == 6:  # a length-delimited field that claims more than it holds
        return bytes(b) + bytes([0x0A]) + (0xFFFFFFFF).to_bytes(5, "little")[:5] + rng.randbytes(3)
    return bytes(b)  # as it was: the message itself


def text(rng: random.Random) -> str:
    return rng.choice(["", "w0", "w1", "fuzz-pusher", "x" * rng.randint(1, 300), "\u00e9\u0000\ufffd", "127.0.0.1:1"])


def coordinator_message(rng: random.Random, method: str) -> bytes:
    n = rng.randrange(2**32)
    made: dict[str, Any] = {
        "Join": lambda: cpb.JoinRequest(address=text(rng), hostname=text(rng), worker_id=text(rng), rank_hint=rng.randint(-5, 5), view_id=n),
        "Leave": lambda: cpb.LeaveRequest(worker_id=text(rng)),
        "Heartbeat": lambda: cpb.HeartbeatRequest(worker_id=text(rng), view_id=n, stalled=[text(rng)]),
        "Heartbeats": lambda: cpb.HeartbeatRequest(worker_id=text(rng), view_id=n),
        "WatchView": lambda: cpb.WatchViewRequest(worker_id=text(rng)),
        "ReportFailure": lambda: cpb.ReportFailureRequest(reporter_id=text(rng), view_id=n, suspect_rank=rng.randint(0, 9), reason=text(rng)),
        "Admit": lambda: cpb.AdmitRequest(worker_id=text(rng), view_id=n),
        "PutParams": lambda: cpb.ParamChunk(key=text(rng), offset=rng.randint(0, 9), total_bytes=rng.randint(0, 1 << 20), data=rng.randbytes(rng.randint(0, 64))),
        "GetParams": lambda: cpb.GetParamsRequest(key=text(rng)),
        "Status": lambda: cpb.StatusRequest(limit=rng.randint(0, 10)),
        "CommitMark": cpb.CommitMarkRequest,
        "RegisterShard": lambda: cpb.RegisterShardRequest(shard_id=text(rng), address=text(rng), shards=rng.randint(0, 4), index=rng.randint(-2, 4)),
        "ListShards": cpb.ListShardsRequest,
    }
    return mutate(rng, made[method]().SerializeToString())


COORDINATOR_METHODS = {  # method: (kind, read-only?)
    "Join": ("unary", False), "Leave": ("unary", False), "Heartbeat": ("unary", False),
    "Heartbeats": ("stream_stream", False), "WatchView": ("unary_stream", True), "ReportFailure": ("unary", False),
    "Admit": ("unary", False), "PutParams": ("stream_unary", False), "GetParams": ("unary_stream", True),
    "Status": ("unary", True), "CommitMark": ("unary", False), "RegisterShard": ("unary", False),
    "ListShards": ("unary", True),
}
SHARD_METHODS = {"Init": ("stream_unary", False), "Push": ("stream_unary", False), "Pull": ("unary_stream", True),
                 "Info": ("unary", True)}


def shard_message(rng: random.Random, method: str) -> bytes:
    if method == "Info":
        return mutate(rng, ps_pb2.InfoRequest().SerializeToString())
    if method == "Pull":
        return mutate(rng, ps_pb2.PullRequest(worker_id=text(rng), min_version=rng.randint(0, 9)).SerializeToString())
    piece = ps_pb2.PieceSpec(key=rng.choice(["w", "v", text(rng)]), start=rng.randint(0, 9), count=rng.randint(0, 4096),
                             dtype=rng.choice(["float32", "float64", "int8", text(rng)]), shape=[rng.randint(0, 4096)])
    if method == "Push":
        first = ps_pb2.PushMessage(header=ps_pb2.PushHeader(worker_id=text(rng), step=rng.randint(0, 9), pieces=[piece]))
    else:
        first = ps_pb2.InitMessage(header=ps_pb2.InitHeader(worker_id=text(rng)))
    return mutate(rng, first.SerializeToString())


def peer_message(rng: random.Random) -> bytes:
    header = peer_pb2.FrameHeader()
    frame = peer_pb2.Frame(header=header, payload=rng.randbytes(rng.choice((0, 8, 4096))))
    return mutate(rng, frame.SerializeToString())


def token_for(rng: random.Random, token: str, read_only: bool) -> tuple[str, str]:
    """(which, the metadata value); the right token only on read-only calls and on garbage."""
    which = rng.choice(["none", "wrong", "replayed"] + (["right"] * 3 if read_only else []))
    value = {"none": "", "wrong": "Bearer " + rng.randbytes(12).hex(), "replayed": f"Bearer {OLD_TOKEN}",
             "right": f"Bearer {token}"}[which]
    return which, value


# -- sending them --------------------------------------------------------------------------


class Outcome:
    def __init__(self, label: str, *, hang: bool = False, fault: str = "") -> None:
        self.label, self.hang, self.fault = label, hang, fault


def grpc_call(channel: grpc.Channel, service: str, method: str, kind: str, messages: list[bytes],
              metadata: list[tuple[str, str]]) -> Outcome:
    path = f"/ringserve.v1.{service}/{method}"
    try:
        if kind == "unary":
            channel.unary_unary(path, request_serializer=identity, response_deserializer=identity)(
                messages[0], timeout=DEADLINE_S, metadata=metadata)
        elif kind == "unary_stream":
            call = channel.unary_stream(path, request_serializer=identity, response_deserializer=identity)(
                messages[0], timeout=STREAM_S, metadata=metadata)
            for _ in zip(range(3), call, strict=False):
                pass
            call.cancel()
        elif kind == "stream_unary":
            channel.stream_unary(path, request_serializer=identity, response_deserializer=identity)(
                iter(messages), timeout=DEADLINE_S, metadata=metadata)
        else:
            call = channel.stream_stream(path, request_serializer=identity, response_deserializer=identity)(
                iter(messages), timeout=STREAM_S, metadata=metadata)
            for _ in zip(range(3), call, strict=False):
                pass
            call.cancel()
    except grpc.RpcError as exc:
        code = exc.code()
        details = exc.details() or ""
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and details not in BAD_BUT_PARSED:
            return Outcome(code.name, fault=f"{method}: {code.name}: {details[:200]}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and kind == "unary":
            return Outcome(code.name, hang=True)  # a unary call the server never answered
        return Outcome(code.name)
    return Outcome("OK")


class Lingering:
    """Connections the server has not closed yet: each must be closed by its deadline (the
    server's own bound on a silent connection), or it hangs. Watched together, so that the
    campaign sends the next input at once instead of waiting out each deadline."""

    MOST = 256

    def __init__(self) -> None:
        self._open: list[tuple[socket.socket, float, str]] = []
        self.hangs: list[str] = []
        self.faults: list[str] = []  # a late HTTP answer that was a server error
        self.closed = 0

    def add(self, sock: socket.socket, deadline: float, label: str) -> None:
        self._open.append((sock, deadline, label))
        while len(self._open) >= self.MOST:
            self.poll(0.05)

    def poll(self, wait_s: float = 0.0) -> None:
        if not self._open:
            return
        readable, _, _ = select.select([s for s, _, _ in self._open], [], [], wait_s)
        now = time.monotonic()
        kept = []
        for sock, deadline, label in self._open:
            done = False
            if sock in readable:
                try:
                    got = sock.recv(65536)
                except OSError:
                    got = b""
                if got.startswith(b"HTTP/1.1 5") or got.startswith(b"HTTP/1.0 5"):
                    self.faults.append(f"{label} {got[:40]!r}")
                done = True  # a close, or an answer: the server did not leave it hanging
            if done:
                self.closed += 1
                sock.close()
            elif now > deadline:
                self.hangs.append(label)
                sock.close()
            else:
                kept.append((sock, deadline, label))
        self._open = kept

    def drain(self) -> None:
        while self._open:
            self.poll(0.1)


def first_answer(sock: socket.socket, send: Callable[[socket.socket], None], look_s: float, deadline: float,
                 lingering: Lingering, label: str) -> bytes | Outcome:
    """Sends with ``send``, then the first bytes back within ``look_s`` (b"": closed); a connection
    still open is handed to ``lingering``, which must see it closed or answered by ``deadline``."""
    try:
        sock.settimeout(1.0)
        send(sock)
        sock.settimeout(look_s)
        return sock.recv(65536)
    except TimeoutError:
        lingering.add(sock, deadline, label)
        return Outcome("left open, watched")
    except OSError as exc:
        sock.close()
        return Outcome(f"reset: {type(exc).__name__}")


def raw_exchange(connect: Callable[[], socket.socket], payload: bytes, *, slow: bool, bound_s: float,
                 lingering: Lingering, label: str) -> Outcome:
    """Sends ``payload`` (its first bytes one at a time when ``slow``); the server must then close
    the connection within ``bound_s`` (watched by ``lingering`` past a first look)."""
    try:
        sock = connect()
    except OSError as exc:
        return Outcome(f"connect: {type(exc).__name__}")
    def send(s: socket.socket) -> None:
        rest = payload
        if slow:
            for i in range(min(len(rest), 16)):
                s.sendall(rest[i:i + 1])
                time.sleep(0.005)
            rest = rest[16:]
        if rest:
            s.sendall(rest)

    deadline = time.monotonic() + bound_s
    got = first_answer(sock, send, 0.005, deadline, lingering, label)
    if isinstance(got, Outcome):
        return got
    if not got:
        sock.close()
        return Outcome("closed")
    lingering.add(sock, deadline, label)  # answered (a refusal byte): it closes next
    return Outcome("answered")


def lane_bytes(rng: random.Random) -> tuple[bytes, bool]:
    kind = rng.randrange(7)
    token = rng.randbytes(16)
    if kind == 0:
        data = rng.randbytes(rng.choice((1, 7, 24, 512, 65536)))
    elif kind == 1:
        data = (MAGIC + token)[: rng.randrange(len(MAGIC) + 16)]
    elif kind == 2:
        data = MAGIC + token + rng.randbytes(rng.randint(0, 64))
    elif kind == 3:  # a TLS ClientHello's first bytes at a plaintext lane
        data = bytes([0x16, 0x03, 0x01, 0x00, 0xC8, 0x01]) + rng.randbytes(rng.randint(0, 200))
    elif kind == 4:
        data = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    elif kind == 5:
        data = b""  # connect, say nothing: closed at the hello deadline
    else:
        data = mutate(rng, MAGIC + token)
    return data, rng.random() < 0.05


def status_request(rng: random.Random, token: str, host: str) -> bytes:
    method = rng.choice(["GET", "GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "GE T", "\x00", "X" * 40])
    path = rng.choice(["/", "/status.json", "/login", "/static/status.js", "/static/../x", "/?token=" + token,
                       "/?token=" + rng.randbytes(8).hex(), "/" + rng.randbytes(rng.randint(0, 64)).hex(), "*", "//"])
    lines = [f"{method} {path} HTTP/1.1"]
    lines.append("Host: " + rng.choice([host, "localhost", "evil.example", "", "a" * 300]))
    if rng.random() < 0.3:
        lines.append("Authorization: " + rng.choice([f"Bearer {token}", "Bearer x", "Basic abc", "", "Bearer " + "a" * 2000]))
    if rng.random() < 0.3:
        lines.append("Cookie: ringserve_status=" + rng.randbytes(rng.randint(0, 40)).hex())
    body = b""
    if rng.random() < 0.4:
        body = rng.choice([b"token=" + rng.randbytes(8).hex().encode(), b"token=" + token.encode(), rng.randbytes(100)])
        length = rng.choice([len(body), len(body) + 10, max(len(body) - 3, 0), -1, 10**12])
        lines.append(f"Content-Length: {length}")
    lines.append("Connection: close")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body
    return mutate(rng, raw) if rng.random() < 0.25 else raw


def http_exchange(host: str, port: int, request: bytes, lingering: Lingering, label: str) -> Outcome:
    """Sends one request; an answer or a close must come within the page's own bounds (its idle
    and request deadlines), watched by ``lingering`` past a first look."""
    try:
        sock = socket.create_connection((host, port), timeout=DEADLINE_S)
    except OSError as exc:
        return Outcome(f"connect: {type(exc).__name__}")
    first = first_answer(sock, lambda s: s.sendall(request), 0.05, time.monotonic() + PAGE_BOUND_S, lingering, label)
    if isinstance(first, Outcome):
        return first
    sock.close()
    if not first:
        return Outcome("closed")
    parts = first.split(b" ", 2)
    status = parts[1].decode("latin-1", "replace") if len(parts) > 1 else "?"
    if status.startswith("5"):
        return Outcome(f"HTTP {status}", fault=f"HTTP {status} for {request[:80]!r}")
    return Outcome(f"HTTP {status}")


class Campaign:
    def __init__(self, surfaces: dict[str, Any], seed: int) -> None:
        self.s = surfaces
        self.seed = seed
        self.token = surfaces["token"]
        self._channels: dict[str, grpc.Channel] = {}
        self.lingering = Lingering()

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address, options=[
                ("grpc.max_send_message_length", 80 << 20), ("grpc.max_receive_message_length", 80 << 20)])
        return self._channels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def one(self, surface: str, index: int) -> Outcome:
        rng = random.Random(f"{self.seed}:{surface}:{index}")
        if surface in ("coordinator", "shard"):
            methods = COORDINATOR_METHODS if surface == "coordinator" else SHARD_METHODS
            method = rng.choice(sorted(methods))
            kind, read_only = methods[method]
            draw = (lambda: coordinator_message(rng, method)) if surface == "coordinator" else (lambda: shard_message(rng, method))
            messages = [draw() for _ in range(rng.randint(1, 3) if kind.startswith("stream") else 1)]
            if rng.random() < 0.002:  # one oversized message now and then (past max_message_bytes)
                messages[0] = rng.randbytes(1) * (65 << 20)
            _, value = token_for(rng, self.token, read_only)
            address = self.s["coordinator"] if surface == "coordinator" else self.s["shard"]
            return grpc_call(self.channel(address), "Coordinator" if surface == "coordinator" else "ParameterServer",
                             method, kind, messages, [("authorization", value)] if value else [])
        if surface == "peer":
            address = rng.choice(self.s["peers"])
            # A member's stream with the token, sometimes: frames that are not a HELLO of the view.
            _, value = token_for(rng, self.token, rng.random() < 0.25)
            if rng.random() < 0.1:
                return grpc_call(self.channel(address), "Peer", "Latest", "unary", [mutate(rng, b"")],
                                 [("authorization", value)] if value else [])
            frames = [peer_message(rng) for _ in range(rng.randint(1, 4))]
            return grpc_call(self.channel(address), "Peer", "Stream", "stream_unary", frames,
                             [("authorization", value)] if value else [])
        if surface == "lane":
            port = rng.choice(self.s["lanes"])
            data, slow = lane_bytes(rng)
            return raw_exchange(lambda: socket.create_connection(("127.0.0.1", port), timeout=2), data, slow=slow,
                                bound_s=HELLO_S + 2, lingering=self.lingering, label=f"lane:{index}")
        if surface == "fdsock":
            path = rng.choice(self.s["fd_sockets"])

            def connect() -> socket.socket:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(path)
                except OSError:
                    s.close()
                    raise
                return s
            data = rng.choice([rng.randbytes(16), rng.randbytes(rng.randint(0, 15)), rng.randbytes(64), b""])
            return raw_exchange(connect, data, slow=rng.random() < 0.05, bound_s=FD_TIMEOUT_S + 2,
                                lingering=self.lingering, label=f"fdsock:{index}")
        host, _, port = self.s["status"].split("//", 1)[1].rstrip("/").rpartition(":")
        return http_exchange(host, int(port), status_request(rng, self.token, f"{host}:{port}"), self.lingering,
                             f"status:{index}")


# -- the campaign --------------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    """VmHWM of ``pid`` in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start_target(directory: Path) -> subprocess.Popen[bytes]:
    log = (directory / "target.log").open("wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fuzz_target.py"), str(directory)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (directory / "surfaces.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the fuzz target did not start: {(directory / 'target.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc


def progress(directory: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads((directory / "progress.json").read_text()))
    return {}


def run(inputs: int, seed: int, surfaces: list[str], directory: Path) -> dict[str, Any]:
    target = start_target(directory)
    found = json.loads((directory / "surfaces.json").read_text())
    campaign = Campaign(found, seed)
    report: dict[str, Any] = {"seed": seed, "inputs": inputs, "surfaces": {}}
    failed = False
    try:
        for surface in surfaces:
            started = time.monotonic()
            outcomes: Counter[str] = Counter()
            row = {"crashes": 0, "hangs": 0, "faults": 0, "stalls": 0, "examples": []}
            last = progress(directory)
            last_move = time.monotonic()
            for i in range(inputs):
                campaign.lingering.poll()
                got = campaign.one(surface, i)
                outcomes[got.label] += 1
                if got.hang or got.fault:
                    row["hangs" if got.hang else "faults"] += 1
                    if len(row["examples"]) < 5:
                        row["examples"].append(f"{surface}:{i} {got.label} {got.fault}")
                if i % CHECK_EVERY == CHECK_EVERY - 1 or i == inputs - 1:
                    if target.poll() is not None:
                        row["crashes"] += 1
                        row["examples"].append(f"{surface}:{i} the target exited {target.returncode}")
                        break
                    now = progress(directory)
                    moved = (now.get("collectives"), now.get("pushes")) != (last.get("collectives"), last.get("pushes"))
                    if moved and now.get("collectives") != last.get("collectives") and now.get("pushes") != last.get("pushes"):
                        last, last_move = now, time.monotonic()
                    elif time.monotonic() - last_move > STALL_S:
                        row["stalls"] += 1
                        row["examples"].append(f"{surface}:{i} the job stalled: {now}")
                        last_move = time.monotonic()
            campaign.lingering.drain()
            row["hangs"] += len(campaign.lingering.hangs)
            row["faults"] += len(campaign.lingering.faults)
            row["examples"] += [f"{label} left open past its deadline" for label in campaign.lingering.hangs[:5]]
            row["examples"] += [f"{label}: a late server error" for label in campaign.lingering.faults[:5]]
            outcomes["closed after a wait"] = campaign.lingering.closed
            campaign.lingering.hangs, campaign.lingering.faults, campaign.lingering.closed = [], [], 0
            row.update(outcomes=dict(outcomes.most_common()), seconds=round(time.monotonic() - started, 1),
                       peak_rss_mib=round(peak_rss(target.pid) / 2**20, 1))
            report["surfaces"][surface] = row
            failed |= bool(row["crashes"] or row["hangs"] or row["faults"] or row["stalls"])
            print(f"{surface:12s} {inputs} inputs in {row['seconds']:7.1f} s: crashes {row['crashes']}, hangs "
                  f"{row['hangs']}, faults {row['faults']}, stalls {row['stalls']}; peak RSS {row['peak_rss_mib']} MiB; "
                  f"{', '.join(f'{k} {v}' for k, v in list(outcomes.most_common())[:6])}", flush=True)
            for example in row["examples"]:
                print(f"    {example}", flush=True)
        final = progress(directory)
        report["job"] = final
        report["failed"] = failed
    finally:
        campaign.close()
        target.terminate()
        try:
            target.wait(10)
        except subprocess.TimeoutExpired:
            target.kill()
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=1000, help="inputs a surface")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--surfaces", default=",".join(SURFACES), help="a comma-separated subset of " + ", ".join(SURFACES))
    p.add_argument("--replay", default="", help="SURFACE:INDEX: send that one input and print what came back")
    p.add_argument("--json", default="", help="write the report here")
    p.add_argument("--workdir", default="", help="the target's folder (default: a temporary one)")
    opts = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ringserve-fuzz-") as tmp:
        directory = Path(opts.workdir or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        if opts.replay:
            surface, _, index = opts.replay.partition(":")
            target = start_target(directory)
            try:
                campaign = Campaign(json.loads((directory / "surfaces.json").read_text()), opts.seed)
                got = campaign.one(surface, int(index))
                print(f"{opts.replay}: {got.label}{' (hang)' if got.hang else ''} {got.fault}")
                campaign.close()
            finally:
                target.terminate()
                target.wait(10)
            return 0
        report = run(opts.inputs, opts.seed, [s for s in opts.surfaces.split(",") if s], directory)
        if opts.json:
            Path(opts.json).write_text(json.dumps(report, indent=1))
        print(f"job at the end: {report['job']}")
        return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
