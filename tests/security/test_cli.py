"""The commands with TLS and a token: `ringserve coordinator` and `ringserve status` with the
--tls-* and --token-file flags, the health probe, and `ringserve run` passing the job's TLS and
token from the environment to the coordinator it starts and to its workers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
from _secure import TOKEN, Pki

RINGSERVE = [sys.executable, "-m", "ringserve.cli"]

WORKER = """
import numpy as np, ringserve as rs
rs.init()
print("sum", int(rs.allreduce(np.ones(8, np.int64), op="sum")[0]), flush=True)
rs.shutdown()
"""


def tls_flags(pki: Pki) -> list[str]:
    return ["--tls-cert", pki.node.cert, "--tls-key", pki.node.key, "--tls-ca", pki.node.ca]


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "job.token"
    path.write_text(TOKEN)
    return str(path)


@pytest.fixture
def coordinator(pki: Pki, token_file: str, coordinator_process: Callable[..., AbstractContextManager[str]]) -> Iterator[str]:
    args = ["--port", "0", *tls_flags(pki), "--tls-require-client-auth", "--token-file", token_file]
    with coordinator_process(args, r"listening on (\S+) \(mTLS, token required\)") as address:
        yield address


def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, **kwargs)  # type: ignore[call-overload]


@pytest.mark.timeout(60)
def test_status_and_the_health_probe_reach_an_mtls_coordinator_with_the_flags_and_fail_without(
    coordinator: str, pki: Pki, token_file: str
) -> None:
    ok = run([*RINGSERVE, "status", "--coordinator", coordinator, *tls_flags(pki), "--token-file", token_file])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("view 0, 0 workers")
    no_token = run([*RINGSERVE, "status", "--coordinator", coordinator, *tls_flags(pki)],
                   env={k: v for k, v in os.environ.items() if k != "RINGSERVE_TOKEN"})
    assert no_token.returncode == 2 and "UNAUTHENTICATED" in no_token.stderr
    assert TOKEN not in ok.stdout + ok.stderr + no_token.stderr
    probe = [sys.executable, "-m", "ringserve.healthcheck", coordinator, "--service", "ringserve.v1.Coordinator"]
    healthy = run(probe + tls_flags(pki))
    assert healthy.returncode == 0, healthy.stderr
    plaintext = run([*probe, "--timeout", "1"])
    assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr


@pytest.mark.timeout(90)
def test_ringserve_run_gives_the_jobs_tls_and_token_to_its_coordinator_and_workers(pki: Pki, token_file: str) -> None:
    env = {**os.environ, "RINGSERVE_TLS_CERT": pki.node.cert, "RINGSERVE_TLS_KEY": pki.node.key,
           "RINGSERVE_TLS_CA": pki.node.ca, "RINGSERVE_TLS_REQUIRE_CLIENT_AUTH": "1", "RINGSERVE_TOKEN_FILE": token_file}
    done = run([*RINGSERVE, "run", "-np", "2", sys.executable, "-c", WORKER], env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(line for line in done.stdout.splitlines() if "sum" in line) == ["[0] sum 2", "[1] sum 2"]
