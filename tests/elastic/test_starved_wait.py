"""A worker waiting for a new view whose own event loop is starved of CPU keeps waiting until
elastic_timeout_s, the bound of the wait, and does not die of the poll's backstop.

At 256 workers on 2 cores (benchmarks/scale.py, a load of 600), 239 workers waiting for their first
view died of ``CollectiveTimeoutError: A call on the ringserve worker did not finish within
10.25 s``: the elastic wait polls the worker's loop every LEAVE_POLL_S (to see a SIGTERM), and a
poll that the loop did not answer within the slack was taken for the wait's failure. Forced here:
the worker's loop is blocked (time.sleep on it) past the slack, made short for the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent("""
    import time
    import ringserve as rs
    from ringserve import api
    from ringserve.elastic import ObjectState
    from ringserve.elastic import state as elastic_state
    from ringserve.errors import RendezvousTimeoutError

    rs.init()
    ctx = api.context()
    elastic_state.THREAD_WAIT_SLACK_S = 0.2  # the backstop's slack, short: the loop is blocked past it
    loop = ctx._thread.loop
    for k in range(6):  # the loop blocked 1 s at a time for 6 s, as a starved process's would be
        loop.call_later(0.2 + k, time.sleep, 1.0)
    began = time.monotonic()
    try:
        elastic_state.wait_for_view_after(ctx.worker.view_id, ObjectState())
    except RendezvousTimeoutError:
        print(f"rendezvous timeout after {time.monotonic() - began:.1f} s", flush=True)
    rs.shutdown()
""")


def test_a_starved_loop_does_not_end_the_wait_for_a_view_before_its_deadline(coordinator_process) -> None:
    with coordinator_process(["--min-workers", "1", "--max-workers", "1", "--settle-seconds", "0.1"]) as address:
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "RINGSERVE_COORDINATOR": address, "RINGSERVE_ELASTIC_TIMEOUT_S": "4"})
    assert done.returncode == 0, done.stderr[-2000:]
    waited = float(done.stdout.split("rendezvous timeout after ")[1].split()[0])
    assert 3.9 <= waited < 8, done.stdout  # its own deadline, not the backstop's 0.45 s
    assert "did not answer within" in done.stderr
