"""A worker behind an L7 gRPC proxy (Debian's nginx, ``grpc_pass``, on loopback): its peers reach
its peer server only through the proxy, so the payload lane of the edge whose receiver must dial
it cannot attach, and that edge falls back to the gRPC stream, which the proxy carries.

The proxy listens on 127.0.0.2, which the worker advertises; the worker itself binds 127.0.0.1, so
its payload port is not at the address its peers know, as behind a proxy on another host. The
edge from the proxied worker falls back at once (nothing listens on 127.0.0.2 at that port), the
edge into it keeps its lane (the proxied worker dials out), and every result stays exact.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from worlds import free_port

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/setup.sh installs Debian's nginx as root)")]

PROXY_HOST = "127.0.0.2"

CONF = """
daemon off;
master_process off;
worker_processes 1;
user root;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen {host}:{port} http2;
        client_max_body_size 0;        # a peer stream is one long request body
        client_body_timeout 300s;
        location / {{
            grpc_pass grpc://127.0.0.1:{target};
            grpc_read_timeout 300s;
            grpc_send_timeout 300s;
        }}
    }}
}}
"""


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(proxy port, target port): nginx on PROXY_HOST:proxy port, passing gRPC to 127.0.0.1:target."""
    assert NGINX is not None
    port, target = free_port(), free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(CONF.format(tmp=tmp_path, host=PROXY_HOST, port=port, target=target))
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["python3", "-c", f"import socket; socket.create_connection(('{PROXY_HOST}', {port}), 1)"],
                             capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"nginx did not start: {out} {(tmp_path / 'error.log').read_text() if (tmp_path / 'error.log').exists() else ''}")
            time.sleep(0.05)
        yield port, target
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_behind_an_nginx_grpc_proxy_the_edge_falls_back_at_once_and_results_stay_exact(
    world_factory, proxy: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ringserve.worker")
    port, target = proxy
    behind = {"bind_port": target, "advertise_host": PROXY_HOST, "advertise_port": port}
    world = await world_factory(2, shared_memory=False, chunk_bytes=64 << 10,
                                each=lambda i: {"rank_hint": i, **(behind if i == 1 else {})})
    direct, proxied = world.workers
    assert proxied.address == f"{PROXY_HOST}:{port}"
    rng = np.random.default_rng(7)
    for k in range(4):
        xs = [rng.standard_normal(300_000).astype(np.float32) for _ in range(2)]
        start = time.monotonic()
        outs = await world.map("allreduce", xs, op="sum", name=f"x{k}")
        assert time.monotonic() - start < 10
        assert outs[0].tobytes() == outs[1].tobytes()
        np.testing.assert_allclose(outs[0], xs[0] + xs[1], rtol=1e-6)
    bcast = await world.map("broadcast", [np.arange(100_000.0) * (w + 1) for w in range(2)], root=1, name="b")
    assert all(np.array_equal(b, np.arange(100_000.0) * 2) for b in bcast)
    # The proxied worker's payloads took the stream through nginx; the other's took its lane.
    assert direct.counters.lane_fallbacks == 1 and proxied.counters.lane_fallbacks == 0
    assert proxied.counters.lane_bytes_sent == 0 and direct.counters.lane_bytes_sent > 1 << 20
    assert f"rank 1 ({PROXY_HOST}:{port}) -> rank 0" in caplog.text and "Connection refused" in caplog.text
