"""Measurements of an emulated WAN (_netem.Wan): TCP connect time and bulk goodput, one flow or all at once."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Sequence

from _netem import Host, in_netns


def connect_rtt_ms(source: Host, target: Host, samples: int = 5) -> float:
    """Median TCP connect time from ``source`` to ``target`` in ms: one round trip."""
    with in_netns(target.netns):
        server = socket.create_server((target.address, 0), backlog=samples)
    times = []
    with server:
        port = server.getsockname()[1]
        for _ in range(samples):
            with in_netns(source.netns):
                client = socket.socket()
            with client:
                client.settimeout(10)
                t0 = time.perf_counter()
                client.connect((target.address, port))
                times.append(time.perf_counter() - t0)
                server.accept()[0].close()
    return 1e3 * statistics.median(times)


def bulk_mbit(source: Host, target: Host, nbytes: int) -> float:
    """Goodput of one TCP transfer of ``nbytes`` from ``source`` to ``target``, in Mbit/s."""
    return transfers_mbit([(source, target)], nbytes)[0]


def ring_bulk_mbit(hosts: Sequence[Host], nbytes: int) -> list[float]:
    """Goodputs in Mbit/s of ``nbytes`` sent by every host to the next, all at once, as a ring
    allreduce loads the links. Every uplink near its rate shows that the switch keeps up."""
    return transfers_mbit([(h, hosts[(i + 1) % len(hosts)]) for i, h in enumerate(hosts)], nbytes)


def transfers_mbit(pairs: Sequence[tuple[Host, Host]], nbytes: int) -> list[float]:
    """Goodputs in Mbit/s of TCP transfers of ``nbytes`` from each source to its target, run at once."""
    servers, clients = [], []
    try:
        for source, target in pairs:
            with in_netns(target.netns):
                servers.append(socket.create_server((target.address, 0)))
            with in_netns(source.netns):
                clients.append(socket.socket())
        results: list[float] = [0.0] * len(pairs)
        threads = [threading.Thread(target=_transfer, args=(c, s, pairs[i][1].address, nbytes, results, i),
                                    daemon=True) for i, (c, s) in enumerate(zip(clients, servers, strict=True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for sock in servers + clients:
            sock.close()
    if not all(results):
        raise RuntimeError(f"a bulk transfer of {nbytes} bytes did not finish within 120 s")
    return results


def _transfer(client: socket.socket, server: socket.socket, address: str, nbytes: int, results: list[float],
              index: int) -> None:
    """Sends ``nbytes`` from ``client`` to ``server``; puts the goodput in Mbit/s at ``results[index]``."""
    client.settimeout(60)
    client.connect((address, server.getsockname()[1]))
    sender = threading.Thread(target=_send_and_close, args=(client, nbytes), daemon=True)
    sender.start()
    conn, _ = server.accept()
    with conn:
        conn.settimeout(60)
        received, t0 = _receive_all(conn)
    sender.join(60)
    if received != nbytes:
        raise RuntimeError(f"bulk transfer received {received} of {nbytes} bytes")
    results[index] = 8 * nbytes / (time.perf_counter() - t0) / 1e6


def _send_and_close(sock: socket.socket, nbytes: int) -> None:
    with sock:
        block = bytes(1 << 20)
        left = nbytes
        while left > 0:
            sock.sendall(block[:left])
            left -= len(block)


def _receive_all(sock: socket.socket) -> tuple[int, float]:
    """Reads to EOF; returns (bytes, perf_counter of the first byte)."""
    first = sock.recv(1 << 20)
    t0 = time.perf_counter()
    received = len(first)
    while chunk := sock.recv(1 << 20):
        received += len(chunk)
    return received, t0
